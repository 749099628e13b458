"""``python -m gracecomm.experiments.training``: the ``gracecomm-train`` command
(`gracecomm.experiments.training.train.main`), for torchrun and scripts."""

from gracecomm.experiments.training.train import main

if __name__ == "__main__":
    main()
