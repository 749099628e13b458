"""Training: the ``gracecomm-train`` entry point (`train`), the config it composes and checks
(`config`), one rank's training loop (`worker`), the run's summary (`summary`), checkpoints
and what a resumed run may change (`checkpoint`, `resume`), the process launcher (`launch`),
run directories (`rundir`), loggers, and the watches a run keeps (`collapse`,
`consistency`, PyTorch's own DDP hooks as a baseline in `torch_hooks`)."""
