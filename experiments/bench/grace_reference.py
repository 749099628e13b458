"""Suite ``grace_reference``: this library's compressors against the GRACE framework's own
implementations (Xu et al., "GRACE: A Compressed Communication Framework for Distributed
Machine Learning", ICDCS 2021; https://github.com/sands-lab/grace, `grace_dl.dist`), built by
GRACE's own `grace_from_params` and timed on the same tensor in the same process:

    gracecomm-bench suite=grace_reference +grace_reference.path=/path/to/grace
    GRACE_PATH=/path/to/grace gracecomm-bench suite=grace_reference \
        '+grace_reference.methods=[topk,dgc]' +grace_reference.ratios=[0.001]

``path`` (default: the ``GRACE_PATH`` environment variable) is a checkout of GRACE, the
directory that holds ``grace_dl``. GRACE's code is imported from there, never copied into
this repository; without it the suite prints why and returns no records. A method whose
GRACE version cannot run here (natural compression needs cupy and a GPU; PowerSGD all-reduces
inside compress) is listed with the reason.

Each method is timed compress + decompress, ours and GRACE's interleaved with one read of the
tensor (``t.sum()``) in ``rounds`` rounds, on one thread, in process CPU time
(`time.process_time`), keeping each operation's best: the ratios printed are measured in one
process. Options under ``grace_reference``: ``path``, ``methods`` (default: every pair in
`PAIRS`), ``ratios`` for the sparsifiers (default [0.01, 0.001]), ``numel`` (default
26,214,400), ``distribution`` (default laplace), ``rounds`` (default 5).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from gracecomm.experiments.bench import Record, suite, suite_options
from gracecomm.experiments.bench.compressors import synthetic
from gracecomm.experiments.bench.deepreduce import threads
from gracecomm.registry import COMPRESSORS
from gracecomm.wire import payload_nbytes

RATIO = "ratio"  # stands for each of the suite's `ratios` in `PAIRS`
# ours: (registry name, options); GRACE: grace_from_params parameters, the same settings
PAIRS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "none": ({}, {"compressor": "none"}),
    "fp16": ({}, {"compressor": "fp16"}),
    "topk": ({"ratio": RATIO}, {"compressor": "topk", "compress_ratio": RATIO}),
    "randomk": ({"ratio": RATIO}, {"compressor": "randomk", "compress_ratio": RATIO}),
    "dgc": ({"ratio": RATIO}, {"compressor": "dgc", "compress_ratio": RATIO}),
    "threshold": ({"threshold": 2.0}, {"compressor": "threshold", "threshold": 2.0}),
    "qsgd": ({"levels": 127, "bucket": 128},
             {"compressor": "qsgd", "quantum_num": 127, "bucket_size": 128}),
    "terngrad": ({}, {"compressor": "terngrad"}),
    "signsgd": ({}, {"compressor": "signsgd"}),
    "signum": ({"momentum": 0.9}, {"compressor": "signum", "momentum": 0.9}),
    "efsignsgd": ({}, {"compressor": "efsignsgd"}),
    "onebit": ({}, {"compressor": "onebit"}),
    "natural": ({}, {"compressor": "natural"}),
    "powersgd": ({}, {"compressor": "powersgd"}),
}
UNAVAILABLE = {"powersgd": "GRACE's PowerSGD all-reduces inside compress (needs a process "
                           "group), so it does not time on its own"}


def grace_factory(path: str | None) -> tuple[Callable[[dict[str, Any]], Any] | None, str]:
    """GRACE's `grace_from_params` imported from the checkout at `path`, or (None, why not)."""
    if not path:
        return None, ("no GRACE checkout given: set +grace_reference.path=DIR or GRACE_PATH "
                      "(DIR holds grace_dl; git clone https://github.com/sands-lab/grace)")
    root = Path(path).expanduser().resolve()
    if not (root / "grace_dl" / "dist" / "helper.py").is_file():
        return None, f"{root} is not a GRACE checkout (no grace_dl/dist/helper.py in it)"
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    helper = importlib.import_module("grace_dl.dist.helper")

    def build(params: dict[str, Any]) -> Any:
        return helper.grace_from_params({"memory": "none", "communicator": "allgather",
                                         "world_size": 1, **params}).compressor
    return build, ""


def bind(options: dict[str, Any], ratio: float) -> dict[str, Any]:
    return {k: ratio if v == RATIO else v for k, v in options.items()}


def fastest(ops: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Best process CPU time of each operation over `rounds` interleaved rounds (one warm-up
    call each first)."""
    for op in ops.values():
        op()
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(rounds):
        for key, op in ops.items():
            start = time.process_time()
            op()
            best[key] = min(best[key], time.process_time() - start)
    return best


def compare(label: str, ours: Any, theirs: Any, tensor: torch.Tensor, rounds: int) -> Record:
    """Ours and GRACE's compressor, compress + decompress, next to one read, interleaved."""
    payload, ctx = ours.compress(tensor, "bench")
    ref_payload, ref_ctx = theirs.compress(tensor, "bench")
    ref_tensors = ref_payload if isinstance(ref_payload, (list, tuple)) else [ref_payload]
    t = fastest({"read": tensor.sum,
                 "compress": lambda: ours.compress(tensor, "bench"),
                 "decompress": lambda: ours.decompress(payload, ctx),
                 "ref_compress": lambda: theirs.compress(tensor, "bench"),
                 "ref_decompress": lambda: theirs.decompress(ref_payload, ref_ctx)}, rounds)
    total, ref_total = t["compress"] + t["decompress"], t["ref_compress"] + t["ref_decompress"]
    numel = tensor.numel()
    return {"method": label, "numel": numel, "read_s": t["read"],
            "compress_s": t["compress"], "decompress_s": t["decompress"], "total_s": total,
            "x_read_total": total / t["read"],
            "bits_per_element": 8 * payload_nbytes(payload) / numel,
            "grace_compress_s": t["ref_compress"], "grace_decompress_s": t["ref_decompress"],
            "grace_total_s": ref_total, "grace_x_read_total": ref_total / t["read"],
            "grace_bits_per_element": 8 * sum(torch.as_tensor(x).numel()
                                              * torch.as_tensor(x).element_size()
                                              for x in ref_tensors) / numel,
            "x_faster_than_grace": ref_total / total}


@suite("grace_reference")
def run(cfg: DictConfig) -> list[Record]:
    opts = suite_options(cfg, "grace_reference")
    build, why = grace_factory(opts.get("path", os.environ.get("GRACE_PATH")))
    if build is None:
        print(f"grace_reference: skipped, {why}", flush=True)
        return []
    ratios = [float(r) for r in opts.get("ratios", [0.01, 0.001])]
    numel, rounds = int(opts.get("numel", 26_214_400)), int(opts.get("rounds", 5))
    tensor = synthetic(str(opts.get("distribution", "laplace")), numel, int(cfg.seed))
    records: list[Record] = []
    with threads(1):
        for name in opts.get("methods", list(PAIRS)):
            ours_options, grace_params = PAIRS[name]
            for ratio in (ratios if RATIO in ours_options.values() else [None]):
                label = name if ratio is None else f"{name} {ratio:g}"
                if name in UNAVAILABLE:
                    records.append({"method": label, "numel": numel,
                                    "skipped": UNAVAILABLE[name]})
                    print(f"{label:>16}: skipped, {UNAVAILABLE[name]}", flush=True)
                    continue
                ours = COMPRESSORS.get(name)(**bind(ours_options, ratio))
                theirs = build(bind(grace_params, ratio))
                try:
                    rec = compare(label, ours, theirs, tensor, rounds)
                except ImportError as err:  # natural: cupy
                    reason = f"GRACE's version needs {err.name or err} (a CUDA GPU)"
                    records.append({"method": label, "numel": numel, "skipped": reason})
                    print(f"{label:>16}: skipped, {reason}", flush=True)
                    continue
                records.append(rec)
                print(f"{label:>16}: ours {1e3 * rec['total_s']:8.1f} ms "
                      f"({rec['x_read_total']:5.1f}x read), GRACE {1e3 * rec['grace_total_s']:8.1f}"
                      f" ms ({rec['grace_x_read_total']:5.1f}x read): "
                      f"{rec['x_faster_than_grace']:.1f}x faster", flush=True)
    return records
