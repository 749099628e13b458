"""``python -m gracecomm.experiments.training``: the ``gracecomm-train`` command
(`gracecomm.experiments.training.job.main`), for torchrun and scripts."""

from gracecomm.experiments.training.job import main

if __name__ == "__main__":
    main()
