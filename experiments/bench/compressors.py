"""Suite ``compressors``: compress and decompress time, payload bytes, achieved k / target k
and relative error ||g - C(g)|| / ||g|| of registered compressors on synthetic tensors, next
to one read of the tensor (``t.sum()``) and ``torch.topk`` on ``|t|`` timed in the same run."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.bench import Record, suite
from grace.metrics import Metrics
from grace.registry import COMPRESSORS
from grace.timing import best_of
from grace.validation import ConfigError, num_kept
from grace.wire import payload_nbytes


def synthetic(distribution: str, numel: int, seed: int) -> torch.Tensor:
    """A float32 tensor of `numel` draws from a named distribution (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    if distribution == "gaussian":
        return torch.randn(numel, generator=gen)
    if distribution == "laplace":
        u = torch.rand(numel, generator=gen) - 0.5
        return -torch.sign(u) * torch.log1p(-2 * u.abs())
    if distribution.startswith("student_t"):
        dof = float(distribution.partition(":")[2] or 3)
        chi2 = torch.distributions.Chi2(torch.tensor(dof))
        torch.manual_seed(seed)
        return torch.randn(numel, generator=gen) / torch.sqrt(chi2.sample((numel,)) / dof)
    raise ConfigError(f"bench: unknown distribution {distribution!r}; use gaussian, laplace, "
                      "student_t or student_t:<degrees of freedom>")


def method_instances(methods: Any, ratios: list[float]) -> Iterator[tuple[str, float | None, Any]]:
    """(label, ratio, compressor) for every method spec; methods with a `ratio` option are
    built once per ratio."""
    for spec in methods:
        spec = dict(OmegaConf.to_container(spec, resolve=True)) if not isinstance(spec, str) \
            else {"name": spec}
        name = spec.pop("name")
        cls = COMPRESSORS.get(name)
        label = spec.pop("label", name)
        if "ratio" in inspect.signature(cls.__init__).parameters and "ratio" not in spec:
            for ratio in ratios:
                yield label, ratio, cls(ratio=ratio, **spec)
        else:
            yield label, spec.get("ratio"), cls(**spec)


def measure(compressor: Any, tensor: torch.Tensor, repeats: int) -> Record:
    """Time compress and decompress of one tensor and describe the result."""
    metrics = Metrics()
    compressor.bind(None, metrics)
    name = "bench"
    payload, ctx = compressor.compress(tensor, name)
    out = compressor.decompress(payload, ctx)
    stats = metrics.pop()
    compress_s = best_of(lambda: compressor.compress(tensor, name), repeats)
    metrics.pop()
    decompress_s = best_of(lambda: compressor.decompress(payload, ctx), repeats)
    err = float(torch.linalg.vector_norm((tensor - out).double())
                / torch.linalg.vector_norm(tensor.double()).clamp_min(1e-300))
    return {"compress_s": compress_s, "decompress_s": decompress_s,
            "payload_bytes": payload_nbytes(payload),
            "bytes_vs_dense": payload_nbytes(payload) / (tensor.numel() * tensor.element_size()),
            "quality": stats["k_hat"] / stats["k"] if stats.get("k") else math.nan,
            "rel_error": err}


@suite("compressors")
def run(cfg: DictConfig) -> list[Record]:
    records: list[Record] = []
    for distribution in cfg.distributions:
        for numel in cfg.sizes:
            tensor = synthetic(distribution, int(numel), int(cfg.seed))
            read_s = best_of(lambda: tensor.sum(), cfg.repeats)
            topk_s = {r: best_of(lambda: torch.topk(tensor.abs(), num_kept(tensor.numel(), r),
                                                    sorted=False), cfg.repeats)
                      for r in cfg.ratios}
            for label, ratio, compressor in method_instances(cfg.methods, list(cfg.ratios)):
                rec = {"method": label, "dist": distribution, "numel": int(numel),
                       "ratio": ratio, **measure(compressor, tensor, int(cfg.repeats))}
                rec["read_s"] = read_s
                rec["topk_s"] = topk_s.get(ratio, math.nan)
                rec["x_read"] = rec["compress_s"] / read_s
                rec["x_read_total"] = (rec["compress_s"] + rec["decompress_s"]) / read_s
                rec["topk_speedup"] = rec["topk_s"] / rec["compress_s"]
                records.append(rec)
                print(f"{label:>14} {distribution:>10} {int(numel):>10} ratio={ratio} "
                      f"compress {1e3 * rec['compress_s']:.2f} ms "
                      f"({rec['x_read']:.1f}x read, {rec['topk_speedup']:.1f}x faster than topk)",
                      flush=True)
    return records
