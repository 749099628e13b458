"""GPU readiness in one command: ``gracecomm-gpucheck [device=cuda|cpu] [overrides]``.

Four checks, one report (``gpucheck.md`` and ``gpucheck.json`` in the run directory) and
one JSON line printed last (docs/gpu.md):

1. **Agreement.** Every registered compressor, a DeepReduce per index and per value codec,
   and the `variants` of configs/gpucheck.yaml, each built from its Hydra config as
   ``gracecomm-train compressor=NAME`` builds it, compress the same tensors on the device and
   on the CPU (the default CPU path, numba kernels included): payloads, decompressed tensors
   and the aggregate of two payloads (methods that are not summable), then a few steps of
   the method's whole pipeline (its default memory and communicator, in a world of one).
   A method agrees when the results are bit-identical; a deterministic one may also be
   ``close`` (differences from the order of floating-point sums only: few elements, or all
   within `tolerance.close_relative`), and a random one (a part that draws from the
   device's generator, ``rng=torch``, or trains a network) must give the same statistics
   (error and nonzeros within `tolerance.statistics`).
2. **Staying on the device.** Every payload tensor and result must be on the device, and the
   host round trips of the device run are counted per phase and per line of code
   (`gracecomm.experiments.checks.hostwatch`; on CUDA also `torch.cuda.set_sync_debug_mode`). A
   method that hands a device tensor to numpy, or mixes host tensors into device work,
   fails; syncs and host copies are reported with the lines that make them.
3. **Speed.** compress + decompress at each of `sizes` against ``torch.topk`` (k of the
   method's ratio) and one read of the tensor (``t.sum()``), timed in turn in the same run:
   CUDA events on the GPU, warm-up excluded; process CPU time on the CPU. Timed last, while
   `budget_s` has not passed, so that a slow machine still reports the other checks.
4. **DDP.** ``gracecomm-train`` runs `ddp.steps` steps of the default experiment through the
   DDP hook for each of `ddp.methods`: NCCL with 2 ranks where there are 2 or more GPUs,
   else Gloo carrying CUDA tensors (CPU: Gloo on CPU tensors).

``device=cpu`` runs the same checks on the CPU, where the device run takes the torch code
paths (`gracecomm.compressors.shared.stochastic.torch_paths`) that CUDA tensors take, and
the host round trips are found by emulation: this keeps the check from rotting (the test
suite runs it) and tests the device code paths on machines without a GPU.

Exit status: 0 when every check passes, 1 when one fails, 2 when the device is missing.

    gracecomm-gpucheck                                   # CUDA, every method, 2.6M and 26M
    gracecomm-gpucheck device=cpu sizes=[65536] ddp.methods=[none]   # the CI form
    gracecomm-gpucheck methods=[topk,sidco] ddp.methods=[]
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import gracecomm
from gracecomm import communicators, compressors, memories
from gracecomm.compressor import Compressor, Payload
from gracecomm.compressors.shared.stochastic import torch_paths
from gracecomm.config import guarded
from gracecomm.experiments.bench.compressors import synthetic
from gracecomm.experiments.bench.timing import best_of_each
from gracecomm.experiments.checks.gpucheck_config import (
    CONFIG_DIR,
    Entry,
    build,
    entries,
    parse_device,
    short_schedule,
    validate,
)
from gracecomm.experiments.checks.gpucheck_report import Record, markdown, summary_line, sync_cells
from gracecomm.experiments.checks.hostwatch import SYNC_KINDS, HostWatch
from gracecomm.experiments.training import rundir  # noqa: F401 - registers ${run_token:}
from gracecomm.state import Stateful
from gracecomm.validation import ConfigError, error_line, num_kept

NO_DEVICE = 2  # exit status: the device asked for is missing
LEVELS = ("identical", "close", "statistics", "differs")  # from best to worst


def parts(obj: Stateful) -> Iterator[Stateful]:
    """`obj` and every part inside it."""
    yield obj
    for child in obj.children():
        yield from parts(child)


def random_parts(compressor: Compressor) -> list[str]:
    """The parts whose results differ from device to device by design: they draw from the
    device's own generator (option ``rng=torch``) or train a network there (LGC's
    autoencoder), so the device is compared with the CPU by statistics."""
    found = []
    for part in parts(compressor):
        name = type(part).__name__
        if getattr(part, "rng", None) == "torch":
            found.append(f"{name} (rng=torch)")
        elif any(isinstance(v, (torch.nn.Module, torch.optim.Optimizer))
                 for v in vars(part).values()):
            found.append(f"{name} (trains a network)")
    return found


def sample(numel: int, seed: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Laplace-distributed float32 test data on the CPU (heavy enough tails for the
    sparsifiers' estimators), of `shape` if given; a new tensor each call."""
    x = _laplace(numel, seed).clone()
    return x.view(shape) if shape is not None else x


@functools.lru_cache(maxsize=64)
def _laplace(numel: int, seed: int) -> torch.Tensor:
    return synthetic("laplace", numel, seed)  # every method sees the same tensors


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` on the CPU (compared bit for bit: NaN and -0.0 included)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def compare(x: torch.Tensor, ref: torch.Tensor, dev: torch.Tensor,
            ref_payload: Payload | None = None, dev_payload: Payload | None = None) -> Record:
    """How the device's result `dev` differs from the CPU's `ref` for input `x`."""
    dev_cpu = dev.detach().cpu()
    identical = same_bits(ref, dev_cpu)
    if ref_payload is not None:
        identical = identical and len(ref_payload) == len(dev_payload) and all(
            same_bits(a, b) for a, b in zip(ref_payload, dev_payload))
    if identical:
        return {"identical": True}
    r, d, xs = ref.double().reshape(-1), dev_cpu.double().reshape(-1), x.double().reshape(-1)
    norm = float(torch.linalg.vector_norm(xs)) or 1.0
    rec = {"identical": False,
           "differing": float((r != d).double().mean()) if r.numel() else 0.0,
           "rel_diff": float(torch.linalg.vector_norm(d - r)) / (
               float(torch.linalg.vector_norm(r)) or 1.0),
           "err_ref": float(torch.linalg.vector_norm(xs - r)) / norm,
           "err_dev": float(torch.linalg.vector_norm(xs - d)) / norm,
           "nnz_ref": int((r != 0).sum()), "nnz_dev": int((d != 0).sum())}
    if ref_payload is not None:
        rec["payload_bytes"] = [sum(t.numel() * t.element_size() for t in p)
                                for p in (ref_payload, dev_payload)]
        rec["payload_identical"] = [same_bits(a, b) for a, b in zip(ref_payload, dev_payload)]
    return rec


def level(rec: Record, tol: DictConfig) -> str:
    """identical, close (within the rounding of sums), statistics, or differs."""
    if rec["identical"]:
        return "identical"
    if rec["differing"] <= tol.close_fraction or rec["rel_diff"] <= tol.close_relative:
        return "close"
    s = float(tol.statistics)
    if (abs(rec["err_dev"] - rec["err_ref"]) <= s * max(rec["err_ref"], 1e-12)
            and abs(rec["nnz_dev"] - rec["nnz_ref"]) <= s * max(rec["nnz_ref"], 1)):
        return "statistics"
    return "differs"


class DeviceRun:
    """The device side of one method: its calls run here, phase by phase, with the host
    round trips recorded (`HostWatch`) and, on CUDA, the syncs
    `torch.cuda.set_sync_debug_mode` reports; on the CPU the torch code paths run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.emulate = device.type == "cpu"
        self.watch = HostWatch(device, emulate=self.emulate)
        self.cuda_syncs: dict[str, int] = {}
        self.misplaced: list[str] = []

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        return self.watch.adopt(x.clone() if self.emulate else x.to(self.device))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.watch.phase = name
        paths = torch_paths() if self.emulate else contextlib.nullcontext()
        if self.device.type != "cuda":
            with paths, self.watch:
                yield
            return
        with paths, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with self.watch:
                    yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        self.cuda_syncs[name] = self.cuda_syncs.get(name, 0) + syncs

    def placed(self, what: str, tensors: Any) -> None:
        """Note each tensor of `tensors` that is not on the device."""
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and not self.watch.on_device(t):
                self.misplaced.append(f"{what}[{i}] on the host")

    def summary(self, calls: dict[str, int]) -> Record:
        """Syncs per call of each phase (`calls`: phase -> calls made), where they are made,
        host copies (elements per call) and everything that left the device."""
        w = self.watch
        syncs = {p: sum(w.count(kind, p) for kind in SYNC_KINDS) / n
                 for p, n in calls.items() if n}
        rec = {"syncs": syncs,
               "sync_sites": w.sites(SYNC_KINDS),
               "host_copies": {f"{p}:{k}": n / calls[p] for (p, k), n in w.copied.items()},
               "host_copy_sites": w.sites(("to_host", "to_device")),
               "numpy": w.sites(("numpy",)), "host_tensors": w.sites(("host_tensor",)),
               "misplaced": sorted(set(self.misplaced))}
        if self.device.type == "cuda":
            rec["cuda_syncs"] = {p: n / calls[p] for p, n in self.cuda_syncs.items()}
        return rec


def check_calls(ref: Compressor, dev: Compressor, run: DeviceRun, cfg: DictConfig
                ) -> list[Record]:
    """compress, decompress and (not summable) aggregate of `cfg.calls` tensors."""
    out = []
    summable = ref.capabilities().summable
    for call in range(int(cfg.calls)):
        x = sample(int(cfg.check_numel), int(cfg.seed) + call)
        p_ref, c_ref = ref.compress(x, "t")
        d_ref = ref.decompress(p_ref, c_ref)
        xd = run.to_device(x)
        with run.phase("compress"):
            p_dev, c_dev = dev.compress(xd, "t")
        with run.phase("decompress"):
            d_dev = dev.decompress(p_dev, c_dev)
        run.placed("payload", p_dev)
        run.placed("decompressed", [d_dev])
        out.append({"what": f"call {call}", **compare(x, d_ref, d_dev, p_ref, p_dev)})
        if not summable:
            a_ref = ref.aggregate([p_ref, p_ref], c_ref)
            with run.phase("aggregate"):
                a_dev = dev.aggregate([p_dev, p_dev], c_dev)
            run.placed("aggregate", [a_dev])
            out.append({"what": f"aggregate {call}", **compare(x, a_ref, a_dev)})
    return out


def pipeline_inputs(numel: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A matrix (PowerSGD's factors), a bias-sized vector and a long vector."""
    rows = 64
    return [("weight", sample(rows * 256, seed, (rows, 256))),
            ("bias", sample(rows, seed + 1)), ("flat", sample(numel, seed + 2))]


def check_pipeline(entry: Entry, run: DeviceRun, cfg: DictConfig
                   ) -> tuple[list[Record], Compressor]:
    """`cfg.pipeline_steps` steps of the method's pipeline (default memory and
    communicator, a world of one) on the CPU and on the device; the comparisons and the
    device's compressor."""
    ref, dev = gracecomm.build(build(entry)), gracecomm.build(build(entry))
    out = []
    for step in range(int(cfg.pipeline_steps)):
        named = pipeline_inputs(int(cfg.check_numel), int(cfg.seed) + 10 * step)
        means_ref = ref.step_many(named)
        moved = [(name, run.to_device(t)) for name, t in named]
        with run.phase("pipeline"):
            means_dev = dev.step_many(moved)
        run.placed("pipeline output", means_dev)
        for (name, x), r, d in zip(named, means_ref, means_dev):
            out.append({"what": f"step {step} {name}", **compare(x, r, d)})
    return out, dev.compressor


def failure(err: BaseException) -> str:
    """The error and the innermost line of the library it came from."""
    ours = {Path(m.__file__).resolve().parent for m in (gracecomm, compressors, memories,
                                                        communicators)}
    where = [f"{Path(f.filename).name}:{f.lineno}"
             for f in traceback.extract_tb(err.__traceback__)
             if any(p in ours for p in Path(f.filename).resolve().parents)]
    text = f"{type(err).__name__}: {err}".strip()
    return text[:600] + (f" (at {where[-1]})" if where else "")


def check_method(entry: Entry, device: torch.device, cfg: DictConfig) -> Record:
    """Agreement with the CPU path and placement on the device for one method."""
    rec: Record = {"overrides": list(entry.overrides)}
    try:
        ref, dev = build(entry), build(entry)
    except Exception as err:  # noqa: BLE001 - reported, the other methods go on
        return {**rec, "agree": "cannot build", "reason": failure(err), "ok": False}
    run = DeviceRun(device)
    direct = not ref.model_level and ref.capabilities().communicators is None
    calls = int(cfg.calls) if direct else 0
    summable = ref.capabilities().summable
    per_phase = {"compress": calls, "decompress": calls,
                 "aggregate": 0 if summable else calls, "pipeline": int(cfg.pipeline_steps)}
    comparisons: list[Record] = []
    try:
        if direct:
            comparisons += check_calls(ref, dev, run, cfg)
        stepped, piped = check_pipeline(entry, run, cfg)
        comparisons += stepped
    except Exception as err:  # noqa: BLE001 - a method that cannot run is listed as such
        return {**rec, "agree": "cannot run", "reason": failure(err), "ok": False,
                **run.summary(per_phase)}
    randoms = sorted(set(random_parts(dev) + random_parts(piped)))
    expect = "statistics" if randoms else "identical"
    levels = [level(c, cfg.tolerance) for c in comparisons]
    agree = max(levels, key=LEVELS.index)
    placement = run.summary(per_phase)
    on_device = not (placement["misplaced"] or placement["numpy"]
                     or placement["host_tensors"])
    agree_ok = agree in (("identical", "close") if expect == "identical"
                         else ("identical", "close", "statistics"))
    worst = max(comparisons, key=lambda c: LEVELS.index(level(c, cfg.tolerance)))
    return {**rec, "agree": agree, "expect": expect, "random_parts": randoms,
            "direct": direct, "on_device": on_device, "ok": agree_ok and on_device,
            "worst": worst, **placement}


def method_ratio(compressor: Compressor, default: float) -> float:
    """The fraction of elements the method keeps (its first part with a ``ratio``)."""
    for part in parts(compressor):
        ratio = getattr(part, "ratio", None)
        if isinstance(ratio, float):
            return ratio
    return default


def time_method(entry: Entry, device: torch.device, numel: int, cfg: DictConfig) -> Record:
    """compress + decompress of `numel` elements next to ``torch.topk`` and ``t.sum()``."""
    compressor = build(entry)
    if compressor.model_level:
        return {"skipped": "model-level: compresses the whole model within its pipeline"}
    shape = (1024, numel // 1024) if numel % 1024 == 0 else (numel,)  # PowerSGD's matrix
    x = sample(numel, int(cfg.seed), shape).to(device)
    k = num_kept(numel, method_ratio(compressor, float(cfg.ratio)))

    def method() -> torch.Tensor:
        return compressor.decompress(*compressor.compress(x, "t"))

    def topk() -> Any:
        return torch.topk(x.view(-1).abs(), k, sorted=False)

    cuda = device.type == "cuda"
    start = time.perf_counter()
    method()
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    slow = first_s > float(cfg.slow_call_s)  # one timed call only
    repeats, warmup = (1, 0) if slow else (int(cfg.repeats), int(cfg.warmup))
    method_s, topk_s, read_s = best_of_each([method, topk, x.sum], repeats, warmup, cuda)
    rec = {"seconds": method_s, "topk_s": topk_s, "read_s": read_s, "k": k,
           "x_read": method_s / read_s, "vs_topk": method_s / topk_s}
    if slow:
        rec["note"] = f"first call {first_s:.2f} s: timed once"
    return rec


def resolve_device(name: str) -> torch.device:
    """The device of option `device`; exits with `NO_DEVICE` and a message when CUDA is
    asked for and missing."""
    device = parse_device(name)
    if device.type == "cuda":
        why = None
        if not torch.cuda.is_available():
            build = torch.version.cuda or "none (a CPU-only build)"
            why = (f"no CUDA device is available (torch {torch.__version__}, CUDA "
                   f"{build}, {torch.cuda.device_count()} devices visible)")
        elif (device.index or 0) >= torch.cuda.device_count():
            why = (f"device {name} does not exist; {torch.cuda.device_count()} CUDA "
                   "devices are visible")
        if why:
            print(f"gpucheck: {why}. Run the same checks on the CPU with device=cpu, or "
                  "on a machine with an NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
            print(json.dumps({"device": name, "ok": False, "error": why}), flush=True)
            sys.exit(NO_DEVICE)
        torch.cuda.set_device(device)
    return device


def commit() -> str:
    """The checked-out commit of the code that ran (``with changes`` when the tree is not
    clean), or ``unknown`` outside a git checkout."""
    root = CONFIG_DIR.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, text=True, capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" with changes" if dirty.strip() else "")


def device_description(device: torch.device) -> Record:
    info = {"commit": commit(), "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, gpus=torch.cuda.device_count())
    else:
        info.update(name=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                    load=[round(v, 1) for v in os.getloadavg()])
    return info


def ddp_check(cfg: DictConfig, device: torch.device, out_dir: Path) -> Record:
    """`ddp.steps` steps of the default experiment through the DDP hook per method."""
    d = cfg.ddp
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    backend = "nccl" if gpus >= int(d.world_size) else "gloo"
    runs: dict[str, Record] = {}
    for method in d.methods:
        run_dir = out_dir / "ddp" / str(method)
        cmd = [sys.executable, "-m", "gracecomm.experiments.training", f"hydra.run.dir={run_dir}",
               f"trainer.device={device.type}", f"trainer.backend={backend}",
               f"trainer.world_size={int(d.world_size)}", f"trainer.max_steps={int(d.steps)}",
               "trainer.epochs=1", "trainer.progress=false", "trainer.exchange=hook",
               f"trainer.timeout_s={float(d.timeout_s)}", f"compressor={method}",
               *short_schedule(cfg, str(method))]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=float(d.timeout_s) + 60)
            code, tail = proc.returncode, (proc.stderr or proc.stdout)[-2000:]
        except subprocess.TimeoutExpired:
            code, tail = None, f"gracecomm-train did not finish in {d.timeout_s} s"
        rec: Record = {"command": " ".join(cmd[2:]), "seconds": time.perf_counter() - start,
                       "returncode": code}
        summary_path = run_dir / "summary.json"
        if code == 0 and summary_path.exists():
            s = json.loads(summary_path.read_text())
            losses = [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl")
                                             .read_text().splitlines())
                      if r.get("type") == "step"]
            rec.update(steps=s["steps"], test_metric=s.get(s.get("metric", ""), None),
                       loss_first=losses[0] if losses else None,
                       loss_last=losses[-1] if losses else None,
                       wire_bytes_per_step=s.get("wire_bytes_per_step"),
                       communicator=s.get("communicator"))
            rec["ok"] = (s["steps"] == int(d.steps) and bool(losses)
                         and all(math.isfinite(v) for v in losses))
        else:
            rec.update(ok=False, error=tail)
        runs[str(method)] = rec
        print(f"ddp {method}: {'ok' if rec['ok'] else 'FAILED'} "
              f"({rec['seconds']:.0f} s)", flush=True)
    return {"backend": backend, "world_size": int(d.world_size), "gpus": gpus,
            "device": device.type, "steps": int(d.steps), "runs": runs,
            "ok": all(r["ok"] for r in runs.values())}


def run_checks(cfg: DictConfig, out_dir: Path, log: Callable[[str], None] = print) -> Record:
    """Every check of the module docstring, in order of importance: agreement and placement
    of every method, the DDP runs, then the timings while `cfg.budget_s` seconds have not
    passed (later ones are skipped, said so in the report); the whole report as one record."""
    device = resolve_device(str(cfg.device))
    if device.type == "cpu":  # ratios of single-threaded CPU times, as gracecomm-bench's
        torch.set_num_threads(int(cfg.threads))
    started = time.perf_counter()
    torch.manual_seed(int(cfg.seed))
    methods: dict[str, Record] = {}
    chosen = entries(cfg)
    for entry in chosen:
        begin = time.perf_counter()
        rec = methods[entry.label] = check_method(entry, device, cfg)
        rec["check_s"] = time.perf_counter() - begin
        log(f"{entry.label:>30}: {rec['agree']:<12} "
            f"{'on device' if rec.get('on_device') else 'OFF DEVICE':<10} "
            f"syncs c/d/a/p {sync_cells(rec.get('syncs', {}))} "
            f"{'ok' if rec['ok'] else 'FAILED'} ({rec['check_s']:.1f} s)")
    ddp = ddp_check(cfg, device, out_dir) if cfg.ddp.methods else {"runs": {}, "ok": True}
    for entry in chosen:
        rec = methods[entry.label]
        rec["timing"] = {}
        for numel in map(int, cfg.sizes):
            if rec["agree"] == "cannot build":
                continue
            if time.perf_counter() - started > float(cfg.budget_s):
                rec["timing"][str(numel)] = {"skipped": f"past budget_s={cfg.budget_s}"}
                continue
            try:
                rec["timing"][str(numel)] = time_method(entry, device, numel, cfg)
            except Exception as err:  # noqa: BLE001 - reported per method
                rec["timing"][str(numel)] = {"error": failure(err)}
        log(f"{entry.label:>30}: " + ", ".join(
            f"{n}: {t['x_read']:.1f} reads, {t['vs_topk']:.2f} x topk" if "x_read" in t
            else f"{n}: {next(iter(t.values()))}" for n, t in rec["timing"].items()))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok = all(m["ok"] for m in methods.values()) and ddp["ok"]
    return {"device": device.type, "ok": ok, "machine": device_description(device),
            "seconds": time.perf_counter() - started,
            "config": OmegaConf.to_container(cfg, resolve=True),
            "methods": methods, "ddp": ddp}


@hydra.main(version_base="1.3", config_path="../../configs", config_name="gpucheck")
def gpucheck_job(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    overrides = list(HydraConfig.get().overrides.task)
    command = " ".join(["gracecomm-gpucheck", *overrides])
    try:
        validate(cfg)
    except ConfigError as err:
        print(error_line(err), file=sys.stderr, flush=True)
        sys.exit(1)
    report = run_checks(cfg, out_dir)
    report["command"] = command
    (out_dir / "gpucheck.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "gpucheck.md").write_text(markdown(report, command))
    print(f"report: {out_dir / 'gpucheck.md'} and gpucheck.json", flush=True)
    print(json.dumps(summary_line(report)), flush=True)
    sys.exit(0 if report["ok"] else 1)


main = guarded(gpucheck_job)  # every composed config checked first (`gracecomm.config.guarded`)

if __name__ == "__main__":
    main()
