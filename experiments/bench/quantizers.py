"""Suite ``quantizers``: compress + decompress time and payload size of the quantisers
(natural compression, dithering, QSGD, TernGrad, sign methods, PowerSGD) on one synthetic
tensor, next to one read of the tensor (``t.sum()``) and, where a copy of GRACE's torch
compressors is present, the same method in GRACE, all timed in the same run:

    gracecomm-bench suite=quantizers
    gracecomm-bench suite=quantizers +quantizers.sizes=[1000000] +quantizers.repeats=3

Options under ``quantizers`` (all optional): ``methods`` (registry names or
{name, label, options...}), ``sizes`` (default [26000000]), ``distribution`` (default
gaussian), ``repeats`` (default: the top-level ``repeats``), ``references`` (path of a Python
file defining ``REFERENCES = {name: factory}`` with GRACE-style compress/decompress; default
``.bench_refs/grace_refs.py`` in the repository, which git ignores: it is a measurement-only
copy that the project does not ship).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from grace.timing import best_of
from gracecomm.experiments.bench import Record, suite
from gracecomm.experiments.bench.compressors import measure, method_instances, synthetic

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_METHODS = [
    "natural", {"name": "natural", "label": "natural/nat8", "wire": "nat8"},
    {"name": "natural", "label": "natural/torch", "rng": "torch"},
    "natural_dithering", "standard_dithering", "qsgd", "terngrad",
    "signsgd", "signum", "efsignsgd", "onebit", "powersgd",
]


def load_references(path: str | None) -> dict[str, Any]:
    """The ``REFERENCES`` mapping of a reference file, or {} when there is none."""
    file = Path(path) if path else ROOT / ".bench_refs" / "grace_refs.py"
    if not file.is_file():
        return {}
    spec = importlib.util.spec_from_file_location("bench_references", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.REFERENCES)


def measure_reference(factory: Any, tensor: torch.Tensor, repeats: int) -> Record:
    """Time a GRACE-style compressor (compress returns (tensors, ctx)). The payload is
    cloned before every decompress because some references decode in place."""
    ref = factory()
    payload, ctx = ref.compress(tensor, "bench")
    tensors = payload if isinstance(payload, (list, tuple)) else [payload]

    def decompress() -> Any:
        copy = [t.clone() for t in tensors]
        return ref.decompress(copy if isinstance(payload, (list, tuple)) else copy[0], ctx)

    return {"ref_compress_s": best_of(lambda: ref.compress(tensor, "bench"), repeats),
            "ref_decompress_s": best_of(decompress, repeats),
            "ref_payload_bytes": sum(t.numel() * t.element_size() for t in tensors)}


def matrix_view(tensor: torch.Tensor) -> torch.Tensor:
    """PowerSGD compresses matrices: a near-square 2-D view of the flat tensor."""
    n = tensor.numel()
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return tensor.view(rows, n // rows)


@suite("quantizers")
def run(cfg: DictConfig) -> list[Record]:
    node = cfg.get("quantizers")
    opts = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    assert isinstance(opts, dict)
    methods = opts.get("methods", DEFAULT_METHODS)
    repeats = int(opts.get("repeats", cfg.repeats))
    references = load_references(opts.get("references"))
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
            if name in references and label == name:
                rec.update(measure_reference(references[name], tensor, repeats))
                rec["ref_total_s"] = rec["ref_compress_s"] + rec["ref_decompress_s"]
                rec["speedup_vs_ref"] = rec["ref_total_s"] / rec["total_s"]
                rec["ref_bits_per_element"] = 8 * rec["ref_payload_bytes"] / int(numel)
            records.append(rec)
            ref = (f", GRACE {1e3 * rec['ref_total_s']:.1f} ms ({rec['speedup_vs_ref']:.1f}x "
                   f"faster), {rec['ref_bits_per_element']:.2f} bits" if "ref_total_s" in rec
                   else "")
            print(f"{label:>20} {int(numel):>10}: {1e3 * rec['total_s']:8.1f} ms = "
                  f"{rec['x_read_total']:6.1f}x t.sum() ({1e3 * read_s:.2f} ms), "
                  f"{rec['bits_per_element']:.3f} bits/element{ref}", flush=True)
    return records
