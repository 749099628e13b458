"""Run directories that two runs never share.

Hydra names a run's directory after the second it started; two runs started in the same
second (with the same compressor) would write the same directory and the second would
overwrite the first one's metrics and summary. So the default directories of
``configs/train.yaml`` and ``configs/bench.yaml`` end in ``${run_token:}``, a name part that
differs between runs that exist at the same time, and a run holds a lock on its directory
while it lives (`claim`), which also stops two runs given the same ``hydra.run.dir`` at once.
Importing this module registers the ``run_token`` resolver.

A run directory also holds Hydra's job log, ``train.log`` (``<hydra.job.name>.log``, from
Hydra's default ``hydra/job_logging``): `to_log_file` writes to it what the user was shown
(the summary, the refusal or failure that ended the run), not printed a second time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import OmegaConf

from gracecomm.experiments.training.launch import launched_externally
from gracecomm.validation import ConfigError

TOKEN_VAR = "GRACECOMM_RUN_TOKEN"
LOGGER = "gracecomm.experiments.training"  # the name the run log's lines carry


def to_log_file(text: str, level: int = logging.INFO) -> None:
    """Write `text`, already shown on the console, to the log files of this process's
    logging (Hydra's job log of the run, ``train.log``), and not to its console. A spawned
    worker has no log file (Hydra configured the launcher's logging), so there the launcher
    writes the worker's summary; under torchrun rank 0 writes its own."""
    record = logging.LogRecord(LOGGER, level, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and level >= handler.level:
            handler.handle(record)


def run_token() -> str:
    """Under torchrun, ``p`` and the master port: every rank of a job shares it and no other
    job can hold it on that host at the same time. Otherwise the launching process's id,
    kept in the environment so that processes it starts (Hydra launchers) name the same
    directory."""
    if launched_externally():
        return f"p{os.environ['MASTER_PORT']}"
    return os.environ.setdefault(TOKEN_VAR, str(os.getpid()))


OmegaConf.register_new_resolver("run_token", run_token, replace=True)


@contextmanager
def claim(run_dir: str | os.PathLike[str], what: str = "run directory",
          remedy: str = "give this run its own hydra.run.dir") -> Iterator[None]:
    """Hold an exclusive lock on `run_dir` (created if needed) for the life of the block or
    of the process; `ConfigError` at once if another live run holds it, naming it as `what`
    and saying `remedy`. The lock (flock on the directory) goes with the process, however
    it ends, and leaves no file behind. A checkpoint directory is claimed the same way."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: the run token alone keeps runs apart
        yield
        return
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"{what} {folder} is in use by another run that is still "
                          f"running; {remedy}") from None
    try:
        yield
    finally:
        os.close(fd)
