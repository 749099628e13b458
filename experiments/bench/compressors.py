"""Suite ``compressors``: compress and decompress time, payload bytes, achieved k / target k
and relative error ||g - C(g)|| / ||g|| of registered compressors, next to one read of the
tensor (``t.sum()``) and ``torch.topk`` on ``|t|`` timed in the same run: ``x_read`` and
``topk_speedup`` compare compression alone, ``x_read_total`` and ``topk_speedup_total``
compression plus decompression, as a user pays them. ``receive_x_read`` is the cost of
aggregating one more rank's payload (`Compressor.aggregate` of ``receive_ranks`` payloads
against one, per extra rank, in reads; summable methods are added by the allreduce itself).
``mem_compress_x`` and ``mem_decompress_x`` are the peak extra resident memory of one call
in units of the tensor's bytes, ``topk_mem_x`` that of ``torch.topk(|t|, k)``
(`gracecomm.experiments.bench.PeakMemory`, measured after all timings; ``peak_memory=false``
skips it). ``step_x_read`` is one whole step of the method's pipeline in a world of one
(`gracecomm.build` with its default memory: compensate, compress, memory update, aggregate), in
reads: what error feedback and the receiving side add to the compression a user pays for.

    gracecomm-bench                        # the defaults of configs/bench.yaml
    gracecomm-bench sizes=[2621440] ratios=[0.001] methods=[topk,sidco,dgc]
    gracecomm-bench gradients=[] distributions=[student_t]   # synthetic only

Sources: synthetic float32 tensors (``distributions``: laplace, gaussian, student_t[:dof]) and
real gradients (``gradients``: model and data set names from configs/), captured while the
model trains, optionally as the error-feedback accumulator g + e of Top-k (``capture``;
such accumulators drift until about 1/ratio steps have passed); sizes beyond one model's
gradient concatenate the latest training steps. Every method sees
``steps`` fresh samples of each source and size (so adaptive methods such as SIDCo settle);
``quality`` is the mean k_hat / k over the second half of them, ``quality_first`` the first
call's, ``quality_first10`` the mean over the first ten, ``quality_p5``/``quality_p95`` the
band over the second half, ``stages`` SIDCo's last number of stages. Times are the best of
``repeats`` calls on the last sample.
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

import gracecomm
from gracecomm.compressors.shared.estimation import ThresholdSparsifier
from gracecomm.config import instantiate
from gracecomm.experiments import presets
from gracecomm.experiments.bench import PeakMemory, Record, suite
from gracecomm.experiments.bench.timing import best_of, best_of_each
from gracecomm.metrics import Metrics
from gracecomm.registry import COMPRESSORS
from gracecomm.validation import ConfigError, num_kept
from gracecomm.wire import payload_nbytes

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
Sampler = Callable[[int, int], torch.Tensor]  # (numel, step) -> tensor


def synthetic(distribution: str, numel: int, seed: int) -> torch.Tensor:
    """A float32 tensor of `numel` draws from a named distribution (seeded). Student-t with
    an integer number of degrees of freedom nu uses a chi-square made of nu squared normals."""
    gen = torch.Generator().manual_seed(seed)
    if distribution == "gaussian":
        return torch.randn(numel, generator=gen)
    if distribution == "laplace":  # Exp(1) magnitudes (1 - U > 0: no Inf) with random signs
        magnitude = -torch.log1p(-torch.rand(numel, generator=gen))
        return torch.where(torch.rand(numel, generator=gen) < 0.5, magnitude, -magnitude)
    if distribution.startswith("student_t"):
        dof = float(distribution.partition(":")[2] or 3)
        if dof.is_integer() and dof <= 16:
            chi2 = torch.zeros(numel)
            for _ in range(int(dof)):
                z = torch.randn(numel, generator=gen)
                chi2.addcmul_(z, z)
        else:
            torch.manual_seed(seed)
            chi2 = torch.distributions.Chi2(torch.tensor(dof)).sample((numel,))
        return torch.randn(numel, generator=gen) / torch.sqrt(chi2 / dof)
    raise ConfigError(f"bench: unknown distribution {distribution!r}; use gaussian, laplace, "
                      "student_t or student_t:<degrees of freedom>")


class GradientStream:
    """Flattened gradients of a model trained with SGD on its data set (both named like the
    files in configs/model and configs/data). With `residual_ratio` the model trains on
    Top-k with error feedback and each captured vector is the accumulator g + e that a
    compressor sees (heavier-tailed than g). `take(numel)` trains one more step and returns
    the latest ceil(numel / P) vectors concatenated, truncated to numel (P: parameters)."""

    def __init__(self, model: str, data: str, seed: int, warmup_steps: int = 30,
                 batch_size: int = 32, lr: float = 0.05, momentum: float = 0.9,
                 residual_ratio: float | None = None) -> None:
        from gracecomm.experiments.workloads.tasks import make_task

        root = OmegaConf.create({"seed": seed})
        root.model = OmegaConf.load(CONFIG_DIR / "model" / f"{model}.yaml")
        root.data = OmegaConf.load(CONFIG_DIR / "data" / f"{data}.yaml")
        torch.manual_seed(seed)
        self.model = instantiate(root.model)
        bundle = instantiate(root.data)
        self.task = make_task(bundle.task, bundle.task_options)
        self.loader = DataLoader(bundle.train, batch_size=batch_size, shuffle=True,
                                 generator=torch.Generator().manual_seed(seed))
        self.batches = iter(self.loader)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum)
        self.k = None if residual_ratio is None else num_kept(self.numel, residual_ratio)
        self.residual = torch.zeros(self.numel)
        self.history: deque[torch.Tensor] = deque()
        for _ in range(warmup_steps):
            self.train_step()

    def train_step(self) -> torch.Tensor:
        """One optimizer step; returns the captured vector."""
        try:
            x, y = next(self.batches)
        except StopIteration:
            self.batches = iter(self.loader)
            x, y = next(self.batches)
        self.optimizer.zero_grad(set_to_none=True)
        self.task.loss(self.model(x), y).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        if self.k is not None:  # Top-k with error feedback
            grad = grad + self.residual
            sent = torch.zeros_like(grad)
            idx = torch.topk(grad.abs(), self.k, sorted=False).indices
            sent[idx] = grad[idx]
            self.residual = grad - sent
            update = sent
        else:
            update = grad
        offset = 0
        for p in self.params:
            p.grad = update[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()
        return grad

    def take(self, numel: int) -> torch.Tensor:
        need = math.ceil(numel / self.numel)
        self.history.append(self.train_step())
        while len(self.history) < need:
            self.history.append(self.train_step())
        while len(self.history) > need:
            self.history.popleft()
        return torch.cat(list(self.history))[:numel]


def sources(cfg: DictConfig) -> Iterator[tuple[str, Sampler]]:
    """(label, sampler) for every synthetic distribution and every real-gradient source."""
    seed = int(cfg.seed)
    for distribution in cfg.distributions:
        yield distribution, lambda numel, step, d=distribution: synthetic(d, numel, seed + step)
    capture = dict(OmegaConf.to_container(cfg.get("capture") or {}, resolve=True))
    for spec in cfg.get("gradients") or []:
        spec = dict(OmegaConf.to_container(spec, resolve=True))
        stream = GradientStream(spec.pop("model"), spec.pop("data"), seed, **{**capture, **spec})
        label = f"grad:{type(stream.model).__name__}"
        yield label, lambda numel, step, s=stream: s.take(numel)


def method_instances(methods: Any, ratios: list[float]) -> Iterator[tuple[str, float | None, Any]]:
    """(label, ratio, compressor) for every method spec: a method preset's name
    (configs/method/, its compressor), a registry name, or ``{name, label, options...}`` (a
    registry name with options); methods with a `ratio` option are built once per ratio."""
    for spec in methods:
        spec = dict(OmegaConf.to_container(spec, resolve=True)) if not isinstance(spec, str) \
            else {"name": spec}
        name = spec.pop("name")
        label = spec.pop("label", name)
        if label != name and label in presets.available():
            raise ConfigError(f"bench: method label '{label}' is the name of a method preset "
                              f"(+method={label}); name the preset, or choose another label")
        if not spec and name in presets.available():
            node = presets.compose(name).compressor
            if "ratio" in node:
                for ratio in ratios:
                    node.ratio = ratio
                    yield label, ratio, instantiate(node)
            else:
                yield label, None, instantiate(node)
            continue
        cls = COMPRESSORS.get(name)
        if "ratio" in inspect.signature(cls.__init__).parameters and "ratio" not in spec:
            for ratio in ratios:
                yield label, ratio, cls(ratio=ratio, **spec)
        else:
            yield label, spec.get("ratio"), cls(**spec)


def observe(compressor: Any, tensor: torch.Tensor) -> tuple[float, int | None]:
    """Compress once; (k_hat / k, stages) of that call (NaN / None where undefined)."""
    metrics = Metrics()
    compressor.bind(None, metrics)
    records: list[dict[str, Any]] = []
    if isinstance(compressor, ThresholdSparsifier):
        compressor.sink = records.append
    compressor.compress(tensor, "bench")
    stats = metrics.pop()
    quality = stats["k_hat"] / stats["k"] if stats.get("k") else math.nan
    return quality, records[-1]["stages"] if records else None


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


def pipeline_step(compressor: Any, tensor: torch.Tensor, repeats: int) -> float:
    """Seconds of one `Grace.step` of `compressor` with its default memory (after one step
    that creates the memory's state)."""
    pipe = gracecomm.build(compressor)
    pipe.step(tensor, "bench")
    seconds = best_of(lambda: pipe.step(tensor, "bench"), repeats)
    pipe.metrics.pop()
    return seconds


def receive(compressor: Any, tensor: torch.Tensor, repeats: int, ranks: int) -> float:
    """Seconds `aggregate` spends per extra rank's payload: (ranks payloads - one) /
    (ranks - 1); NaN for summable compressors (allreduce adds their payloads)."""
    if compressor.capabilities().summable or ranks < 2:
        return math.nan
    calls = [compressor.compress(tensor, "bench") for _ in range(ranks)]
    payloads, ctx = [payload for payload, _ in calls], calls[-1][1]
    one, many = best_of_each([lambda: compressor.aggregate(payloads[:1], ctx),
                              lambda: compressor.aggregate(payloads, ctx)], repeats)
    compressor.metrics.pop()
    return max(0.0, many - one) / (ranks - 1)


def peak_memory(compressor: Any, tensor: torch.Tensor, peak: PeakMemory) -> Record:
    """Peak extra memory of one compress and one decompress, in tensor sizes."""
    nbytes = tensor.numel() * tensor.element_size()
    payload, ctx = compressor.compress(tensor, "bench")
    out = {"mem_compress_x": peak(lambda: compressor.compress(tensor, "bench")) / nbytes,
           "mem_decompress_x": peak(lambda: compressor.decompress(payload, ctx)) / nbytes}
    compressor.metrics.pop()
    return out


def quality_band(values: list[float]) -> Record:
    """Mean and 5th/95th percentiles of k_hat / k over the second half of the steps."""
    late = torch.tensor(values[len(values) // 2:], dtype=torch.float64)
    if late.isnan().any():
        return {"quality": math.nan, "quality_p5": math.nan, "quality_p95": math.nan}
    return {"quality": float(late.mean()), "quality_p5": float(torch.quantile(late, 0.05)),
            "quality_p95": float(torch.quantile(late, 0.95))}


COLUMNS = ("method", "dist", "numel", "ratio", "compress_s", "decompress_s", "payload_bytes",
           "quality", "quality_first", "quality_first10", "quality_p5", "quality_p95", "stages",
           "rel_error", "x_read", "x_read_total", "topk_speedup", "topk_speedup_total",
           "receive_x_read", "step_x_read", "mem_compress_x", "mem_decompress_x", "topk_mem_x")


@suite("compressors", options=("methods", "sizes", "ratios", "distributions", "gradients",
                                "capture", "steps", "receive_ranks", "peak_memory"),
       columns=COLUMNS)
def run(cfg: DictConfig) -> list[Record]:
    records: list[Record] = []
    steps = max(1, int(cfg.get("steps", 1)))
    ranks = int(cfg.get("receive_ranks", 4))
    later: list[tuple[Sampler, int, list[tuple[Record, Any]]]] = []  # for the memory pass
    for source, sample in sources(cfg):
        for numel in map(int, cfg.sizes):
            instances = list(method_instances(cfg.methods, list(cfg.ratios)))
            history: list[list[tuple[float, int | None]]] = [[] for _ in instances]
            for step in range(steps):
                tensor = sample(numel, step)
                for seen, (_, _, compressor) in zip(history, instances):
                    seen.append(observe(compressor, tensor))
            topk_s = {r: best_of(lambda: torch.topk(tensor.abs(), num_kept(numel, r),
                                                    sorted=False), cfg.repeats)
                      for r in cfg.ratios}
            # the read is timed next to every method and its floor used: on a busy machine
            # the ratios then err towards the method looking slower
            read_s, timed = math.inf, []
            for seen, (label, ratio, compressor) in zip(history, instances):
                read_s = min(read_s, best_of(lambda: tensor.sum(), cfg.repeats))
                timed.append({"method": label, "dist": source, "numel": numel, "ratio": ratio,
                              **measure(compressor, tensor, int(cfg.repeats)),
                              "receive_s": receive(compressor, tensor, int(cfg.repeats), ranks),
                              "step_s": pipeline_step(compressor, tensor, int(cfg.repeats)),
                              **quality_band([q for q, _ in seen]),
                              "quality_first": seen[0][0],
                              "quality_first10": sum(q for q, _ in seen[:10]) / len(seen[:10]),
                              "stages": seen[-1][1]})
            for rec in timed:
                label, ratio = rec["method"], rec["ratio"]
                total = rec["compress_s"] + rec["decompress_s"]
                rec["read_s"] = read_s
                rec["topk_s"] = topk_s.get(ratio, math.nan)
                rec["x_read"] = rec["compress_s"] / read_s
                rec["x_read_total"] = total / read_s
                rec["topk_speedup"] = rec["topk_s"] / rec["compress_s"]
                rec["topk_speedup_total"] = rec["topk_s"] / total
                rec["receive_x_read"] = rec["receive_s"] / read_s
                rec["step_x_read"] = rec["step_s"] / read_s
                records.append(rec)
                print(f"{label:>14} {source:>16} {numel:>10} ratio={ratio} "
                      f"compress {1e3 * rec['compress_s']:.2f} ms "
                      f"({rec['x_read']:.1f}x read, {rec['topk_speedup']:.1f}x faster than topk), "
                      f"with decompress {rec['x_read_total']:.1f}x read "
                      f"({rec['topk_speedup_total']:.1f}x faster than topk), "
                      f"k_hat/k {rec['quality']:.3f}", flush=True)
            later.append((sample, numel, [(rec, c) for rec, (_, _, c) in zip(timed, instances)]))
    if cfg.peak_memory:
        memory_pass(later, list(cfg.ratios), steps)
    return records


def memory_pass(later: list[tuple[Sampler, int, list[tuple[Record, Any]]]],
                ratios: list[float], steps: int) -> None:
    """Peak extra memory of every method and of ``torch.topk``, after all timings."""
    peak = PeakMemory()
    for sample, numel, entries in later:
        tensor = sample(numel, steps)
        nbytes = tensor.numel() * tensor.element_size()
        topk_mem = {r: peak(lambda: torch.topk(tensor.abs(), num_kept(numel, r), sorted=False))
                    / nbytes for r in ratios}
        for rec, compressor in entries:
            rec.update(peak_memory(compressor, tensor, peak))
            rec["topk_mem_x"] = topk_mem.get(rec["ratio"], math.nan)
