"""Data-parallel training with compressed gradient exchange (Hydra entry point).

    gracecomm-train                                # 2 Gloo workers, digits, Top-1%
    gracecomm-train compressor=topk compressor.ratio=0.01
    gracecomm-train -m compressor=none,topk,randomk                # a sweep
    torchrun --nproc_per_node=2 -m gracecomm.experiments.training  # join torchrun's group

Without launcher variables the command spawns `trainer.world_size` local workers on
127.0.0.1; under torchrun it joins the launcher's process group instead. Rank 0 writes
``metrics.jsonl`` and ``summary.json`` into the Hydra run directory and prints a summary
(each rank runs `gracecomm.experiments.training.worker.train_worker`); the run directory's
``train.log`` keeps the summary, or the refusal or failure that ended the run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from gracecomm.config import (
    OPT_IN,
    guarded,
    instantiate,
    opted_in,
)
from gracecomm.experiments.cluster.evidence import apply_step_penalty
from gracecomm.experiments.method_defaults import apply_method_defaults, given_keys
from gracecomm.experiments.training import checkpoint, rundir
from gracecomm.experiments.training.collapse import CollapseError
from gracecomm.experiments.training.config import checkpoint_dir_of, resolve_parts, validate
from gracecomm.experiments.training.launch import (
    WorkerError,
    WorkerTimeoutError,
    exit_now,
    launched_externally,
    run_rank,
    spawn,
)
from gracecomm.experiments.training.loggers import run_group, sweep_group
from gracecomm.experiments.training.summary import objective, objective_names, summary_lines
from gracecomm.experiments.training.worker import backend_of, train_worker
from gracecomm.validation import (
    ConfigError,
    MissingDependencyError,
    error_line,
)


def _run_group() -> str:
    hc = HydraConfig.get()
    return sweep_group(hc) if hc.mode == RunMode.MULTIRUN else run_group(hc)


def one_line_errors(run: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """A configuration refused before any worker starts (`ConfigError`, its
    `IncompatibleError`, a `MissingDependencyError`) ends a single run with its one-line message
    and exit code 1 instead of a traceback; a sweep's job raises it as before."""

    @functools.wraps(run)
    def checked(cfg: DictConfig) -> Any:
        try:
            return run(cfg)
        except (ConfigError, MissingDependencyError) as err:
            if HydraConfig.get().mode == RunMode.MULTIRUN:
                raise
            message = error_line(err)
            print(message, file=sys.stderr, flush=True)
            if os.environ.get("RANK", "0") == "0":  # once, also under torchrun
                rundir.to_log_file(message, logging.ERROR)
            sys.exit(1)

    return checked


@contextlib.contextmanager
def claim_run(cfg: DictConfig, run_dir: str) -> Iterator[None]:
    """Lock the run directory and, where the run saves checkpoints, its checkpoint
    directory for the life of the run (`rundir.claim`: a second live run given either is
    refused), and refuse a checkpoint directory that holds another run's checkpoint unless
    the run resumes from it: saving would replace that checkpoint."""
    folder = Path(checkpoint_dir_of(cfg, run_dir))
    with contextlib.ExitStack() as stack:
        stack.enter_context(rundir.claim(run_dir))
        if cfg.trainer.checkpoint_every:
            if folder.resolve() != Path(run_dir).resolve():
                stack.enter_context(rundir.claim(folder, "checkpoint directory",
                                                 "give this run its own trainer.checkpoint_dir"))
            resume = cfg.trainer.resume
            if (folder / checkpoint.MANIFEST).exists() and not (
                    resume and Path(resume).resolve() == folder.resolve()):
                raise ConfigError(f"trainer: option 'checkpoint_dir' is {folder}, which holds "
                                  "the checkpoint of another run, and saving would replace "
                                  f"it: resume from it (trainer.resume={folder}), or give "
                                  "this run another trainer.checkpoint_dir")
        yield


@hydra.main(version_base="1.3", config_path="../../configs", config_name="train")
@one_line_errors
def train_job(cfg: DictConfig) -> float | tuple[float, ...]:
    """Train one configuration; return its `objective` (minimised) to a Hydra sweeper."""
    if launched_externally() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ConfigError("a Hydra multirun (-m) cannot run under torchrun: torchrun starts "
                          "one process group for one training run, so only the first job "
                          "would run. Sweep without torchrun (local workers: "
                          "trainer.world_size=N, any Hydra launcher), or start one torchrun "
                          "per configuration")
    allow = opted_in(HydraConfig.get().overrides.task)
    if cfg.get(OPT_IN, False) and not allow:  # `guard_composition` refused it already
        raise ConfigError(f"a config file sets {OPT_IN}: true; give {OPT_IN}=true on the "
                          "command line to allow any target")
    with open_dict(cfg):
        cfg[OPT_IN] = allow
    compressor = instantiate(cfg.compressor, allow_any_target=allow)
    resolve_parts(cfg, compressor)
    for line in [*apply_method_defaults(cfg, given_keys(HydraConfig.get().overrides.task),
                                        compressor),
                 *apply_step_penalty(cfg, HydraConfig.get().runtime.choices)]:
        if os.environ.get("RANK", "0") == "0":  # once, also under torchrun
            print(line, flush=True)
    validate(cfg)
    names = objective_names(cfg)
    run_dir = HydraConfig.get().runtime.output_dir
    group = _run_group()
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    if launched_externally():  # run this rank and exit, as spawned workers do
        rank = int(os.environ["RANK"])
        with claim_run(cfg, run_dir) if rank == 0 else contextlib.nullcontext():
            run_rank(train_worker, rank, int(os.environ["WORLD_SIZE"]),
                     (cfg_dict, run_dir, group), backend=backend_of(cfg),
                     collective_timeout_s=float(cfg.trainer.collective_timeout_s))
    try:
        with claim_run(cfg, run_dir):
            spawn(train_worker, int(cfg.trainer.world_size), cfg_dict, run_dir, group,
                  backend=backend_of(cfg), timeout_s=float(cfg.trainer.timeout_s),
                  collective_timeout_s=float(cfg.trainer.collective_timeout_s))
    except (KeyboardInterrupt, WorkerError, WorkerTimeoutError) as err:
        # the workers are stopped: say why and exit at once (the interpreter's teardown
        # takes seconds, on a loaded machine sometimes a minute)
        interrupted = isinstance(err, KeyboardInterrupt)
        name = str(err.args[0]) if interrupted and err.args else "SIGINT"
        message = (f"interrupted ({name}): the workers were stopped" if interrupted else
                   error_line(err))
        print(message, file=sys.stderr)
        rundir.to_log_file(message, logging.ERROR)
        exit_now(128 + getattr(signal, name, signal.SIGINT) if interrupted else 1)
    summary_path = os.path.join(run_dir, "summary.json")
    summary = {}
    if os.path.exists(summary_path):
        with open(summary_path, encoding="utf-8") as f:
            summary = json.load(f)
        for line in summary_lines(summary, run_dir):  # rank 0 printed them
            rundir.to_log_file(line)
    # a sweep goes on to its other runs
    if summary.get("collapse") and HydraConfig.get().mode != RunMode.MULTIRUN:
        raise CollapseError(summary["collapse"]["message"])
    return objective(summary, names)


# The ``gracecomm-train`` command: Hydra's entry point (`train_job`), with every config Hydra
# composes checked before any part of it is used (`gracecomm.config.check_composed`: targets,
# ``hydra.*`` callbacks, logging and environment included).
main = guarded(train_job)

