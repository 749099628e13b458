"""Reports of finished runs: the ``gracecomm-report`` command and the Hydra callback that
reports a sweep (`report`), the tables (`tables`), plots (`plots`), the written and logged
report (`writer`), the Weights & Biases training logger (`wandb_logger`) and the LGC
phases' report (`lgc`)."""
