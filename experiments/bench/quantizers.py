"""Suite ``quantizers``: compress + decompress time and payload size of the quantisers
(natural compression, dithering, QSGD, TernGrad, sign methods, PowerSGD) on one synthetic
tensor, next to one read of the tensor (``t.sum()``), timed in the same run (the same
methods against the GRACE framework's own code: suite ``grace_reference``):

    gracecomm-bench suite=quantizers
    gracecomm-bench suite=quantizers +quantizers.sizes=[1000000] +quantizers.repeats=3

Options under ``quantizers`` (all optional): ``methods`` (registry names or
{name, label, options...}), ``sizes`` (default [26000000]), ``distribution`` (default
gaussian), ``repeats`` (default: the top-level ``repeats``).
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig, OmegaConf

from gracecomm.experiments.bench import Record, suite, suite_options
from gracecomm.experiments.bench.compressors import measure, method_instances, synthetic
from gracecomm.experiments.bench.timing import best_of

DEFAULT_METHODS = [
    "natural", {"name": "natural", "label": "natural/nat8", "wire": "nat8"},
    {"name": "natural", "label": "natural/torch", "rng": "torch"},
    "natural_dithering", "standard_dithering", "qsgd", "terngrad",
    "signsgd", "signum", "efsignsgd", "onebit", "powersgd",
]


def matrix_view(tensor: torch.Tensor) -> torch.Tensor:
    """PowerSGD compresses matrices: a near-square 2-D view of the flat tensor."""
    n = tensor.numel()
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return tensor.view(rows, n // rows)


@suite("quantizers")
def run(cfg: DictConfig) -> list[Record]:
    opts = suite_options(cfg, "quantizers")
    methods = opts.get("methods", DEFAULT_METHODS)
    repeats = int(opts.get("repeats", cfg.repeats))
    records: list[Record] = []
    for numel in opts.get("sizes", [26_000_000]):
        tensor = synthetic(str(opts.get("distribution", "gaussian")), int(numel), int(cfg.seed))
        for label, _, compressor in method_instances(OmegaConf.create(methods), []):
            read_s = best_of(tensor.sum, repeats)  # next to every method: load varies
            name = compressor.registry_name
            data = matrix_view(tensor) if name == "powersgd" else tensor
            rec: Record = {"method": label, "numel": int(numel), "read_s": read_s,
                           **measure(compressor, data, repeats)}
            rec["total_s"] = rec["compress_s"] + rec["decompress_s"]
            rec["x_read_total"] = rec["total_s"] / read_s
            rec["bits_per_element"] = 8 * rec["payload_bytes"] / int(numel)
            records.append(rec)
            print(f"{label:>20} {int(numel):>10}: {1e3 * rec['total_s']:8.1f} ms = "
                  f"{rec['x_read_total']:6.1f}x t.sum() ({1e3 * read_s:.2f} ms), "
                  f"{rec['bits_per_element']:.3f} bits/element", flush=True)
    return records
