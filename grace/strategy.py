"""Per-tensor choice of how a gradient is sent (``strategy="auto"``): compressed by the
pipeline's method, cast to fp16, or dense, whichever the cost model says is fastest.

Compression pays only where the bytes it saves take longer on the link than compressing
and decompressing takes: small tensors (biases, norms) rarely gain, and on a fast link
often no tensor does. PyTorch's PowerSGD hook sends a tensor uncompressed when compression
would not save enough (``min_compression_rate``); Espresso (Wang, Lin, Zhu and Ng, "Hi-Speed
DNN Training with Espresso: Unleashing the Full Potential of Gradient Compression with
Near-Optimal Usage Strategies", EuroSys 2023, Secs. 4-5) chooses per tensor from a model of
the step. ``strategy="fixed"`` (the default) compresses every tensor.

How the choice is made:

1. **Warm-up.** The first `warmup_steps` steps compress every tensor with the method; the
   strategy keeps a copy of each tensor it compressed (after error feedback) and the
   collectives each call (a DDP bucket) launched, by kind, count and bytes
   (`gracecomm.exchange.Link.recorded`).
2. **Measurements**, at the start of the next step, before any collective of it, by every
   rank of the exchange's group (all ranks, or the ranks of one local rank across nodes
   with ``hierarchy="node"``):

   - the link: the best of five allreduces of 8 bytes gives the latency alpha, and
     allreduces (best of two) of 64 KiB, 256 KiB, ... until one takes 30 ms longer, or
     reaches the largest bucket's dense bytes (the sizes the choice prices; at most
     16 MiB), give the bandwidth B, by the ring allreduce's time 2(N-1) alpha + 2(N-1)/N n/B
     (`gracecomm.network`), as the cluster calibration does;
   - compute, on the kept tensors: the method's compression and one decompression (best of
     two; the compression of each bucket's tensors apart scaled to that of the bucket at
     once, as a method such as PowerSGD batches them; the compressor's state is restored
     afterwards, so the run goes on as if it had not been timed), the bytes of its payload,
     and the fp16 cast and back (of each bucket's tensors joined, as the fp16 form sends
     them, scaled the same way);
   - agreement: the numbers are averaged over the group and rank 0's average broadcast, so
     every rank decides from the same numbers and the decision is the same on every rank.
3. **The choice**, per call (bucket): with `gracecomm.network.Network` at the probed
   latency and bandwidth and N the group's ranks, a tensor of n elements costs

   - compressed: its share (by payload bytes) of the bucket's recorded collectives, plus
     compression and (N, or 1 for a communicator that sums payloads) decompressions, plus
     one more for error feedback where the memory keeps a residual;
   - fp16: 2n bytes in one ring allreduce, plus the cast;
   - dense: the tensor's bytes in one ring allreduce.

   Each form a bucket uses pays its collectives' latency once, so every set of forms (7)
   is tried, each tensor taking its cheapest form in the set, and the cheapest total wins
   (ties go to the method, then fp16). The method's compression costs accuracy per step
   where fp16 and dense cost next to none: `step_penalty` is how many times the steps to a
   target it needs over a lossless exchange's (1: step time alone; in this repository's
   stored runs on 4 nodes Top-1% needed 2.4 times plain DDP's steps and PowerSGD 1.3 times,
   and the trainer takes the run's method's ratio from there, ``exchange.step_penalty``).
   A plan is weighed by its step times its penalty (1 for one that compresses no tensor):
   the method throughout takes the last warm-up step's wall time (averaged over the ranks),
   a plan of fp16 and dense that step less the method's modelled time plus its own. The
   method is used only where, so weighed, it saves at least `min_saving` (default 0.2) of
   a step over the best choice of fp16 and dense alone: each bucket whole in the cheaper of
   the two, which it then costs what the fixed fp16 or dense method costs (sent whole,
   nothing to feed back; a bucket of several forms pays work per tensor that the model
   does not price). Otherwise every bucket takes that choice. And as the
   model errs by some percent (a few messages' latency, the CPUs' contention), the choice
   of each tensor's cheapest form replaces the plan so chosen (the method throughout, or
   fp16 and dense) only where, weighed the same way, it saves `min_saving` of a step over
   it, too: one of three
   plans (`PLANS`) for all buckets. The decision
   is printed by the trainer as a table (`table`), logged to ``gracecomm.strategy``, kept
   in `decision` and in the state.
4. **Re-made** only when the link, probed again every `recheck_steps` steps, differs from
   the one decided on by more than `margin` (relative, latency or bandwidth); tensors seen
   for the first time after a decision are compressed, kept, and decided at the next step.

Error feedback follows a change of form: every tensor is compensated by the memory first,
and one sent whole, in fp16 or dense, leaves nothing to feed back
(`gracecomm.memory.Memory.update_sent_whole`: ``residual`` forgets its residual; DGC's
memory clears its accumulation, every element transmitted), so a bucket that changes form
carries its residual once and leaves none. The fp16 cast's rounding (relative error at most
2**-11) is dropped, as the fp16 method drops it with its default memory ``none``. A bucket
whose tensors all go whole in one form, with nothing left to carry, then costs what the
fixed fp16 or dense method costs: the DDP hook passes its buffer whole
(`gracecomm.pipeline.Grace.sends_whole`).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gracecomm.exchange import Link
from gracecomm.network import Network
from gracecomm.state import Stateful
from gracecomm.validation import check_choice, check_range
from gracecomm.wire import joined, payload_nbytes

STRATEGIES = ("fixed", "auto")  # the values of the ``strategy`` option
FIXED, AUTO = STRATEGIES
FORMS = ("compressed", "fp16", "dense")  # how one tensor is sent, in order of preference
COMPRESSED, FP16, DENSE = FORMS
CODECS = {FP16: "fp16", DENSE: "none"}  # the registry's compressor of each other form
# the kinds of plan a decision can make (module docstring, step 3), as the table names them
PLANS = {"method": "the method throughout", "mixed": "each tensor its cheapest form",
         "lossless": "fp16 and dense only"}
METHOD, MIXED, LOSSLESS = PLANS

LOG = logging.getLogger("gracecomm.strategy")
PROBE_REPEATS = 5
PROBE_START_BYTES = 64 * 1024
PROBE_MAX_BYTES = 16 * 1024 * 1024
PROBE_ENOUGH_S = 0.03  # a bandwidth probe this much longer than the latency is long enough


def check_strategy(value: Any, owner: str = "pipeline") -> str:
    """`value` if it is one of `STRATEGIES`, else `ConfigError` naming them.

    Args:
        value: The ``strategy`` option.
        owner: Who has the option, for the message.

    Returns:
        `value`.
    """
    return check_choice(value, STRATEGIES, owner, "strategy")


@dataclass(frozen=True)
class TensorCost:
    """One tensor's measurements: elements, bytes per element, the method's payload bytes,
    the method's compression (its share of its bucket's), one decompression, and the fp16
    round trip (seconds)."""

    numel: int
    itemsize: int
    payload_bytes: float
    compress_s: float
    decompress_s: float
    fp16_s: float


@dataclass(frozen=True)
class Model:
    """What a decision is made from: the probed link and the group's size, and how many
    decompressions a compressed tensor costs a rank (the communicator's and the memory's)."""

    latency_s: float
    bandwidth_bps: float  # bytes per second
    world: int
    decompressions: int

    @property
    def net(self) -> Network:
        return Network(self.bandwidth_bps * 8e-9, self.latency_s * 1e6)

    def collective(self, kind: str, calls: float) -> tuple[float, float]:
        """(fixed seconds, seconds per recorded byte) of `calls` collectives of `kind`."""
        if self.world <= 1 or not calls:
            return 0.0, 0.0
        messages, factor = self.net.terms(kind, self.world)
        return calls * messages * self.latency_s, factor / self.bandwidth_bps


def choose(costs: Sequence[TensorCost], recorded: dict[str, list[float]], model: Model,
           forms: Sequence[str] = FORMS, mix: bool = True) -> tuple[list[str], float, float]:
    """The forms of one bucket's tensors (module docstring, step 3).

    Args:
        costs: Each tensor's measurements, in the bucket's order.
        recorded: The collectives the bucket launched compressed, ``{kind: [calls, bytes]}``.
        model: The link and the group.
        forms: The forms to choose from (all of `FORMS`, or fp16 and dense only).
        mix: Whether the tensors may take different forms (False: one form for all).

    Returns:
        (each tensor's form, the modelled seconds of all compressed, those of the choice).
    """
    total_payload = sum(c.payload_bytes for c in costs) or 1.0
    fixed = {COMPRESSED: 0.0}
    per_byte = 0.0  # seconds per payload byte of the compressed form's collectives
    for kind, (calls, nbytes) in recorded.items():
        latency, per_recorded = model.collective(kind, calls)
        fixed[COMPRESSED] += latency
        per_byte += per_recorded * nbytes / total_payload
    fixed[FP16] = fixed[DENSE] = model.collective("allreduce", 1)[0]
    ring = model.collective("allreduce", 1)[1]
    marginal = [{COMPRESSED: c.payload_bytes * per_byte + c.compress_s
                 + model.decompressions * c.decompress_s,
                 FP16: 2 * c.numel * ring + c.fp16_s,
                 DENSE: c.numel * c.itemsize * ring} for c in costs]
    best: tuple[float, list[str]] | None = None
    for size in range(1, len(forms) + 1 if mix else 2):
        for allowed in itertools.combinations(forms, size):
            chosen = [min(allowed, key=lambda f, m=m: (m[f], FORMS.index(f))) for m in marginal]
            total = (sum(fixed[f] for f in set(chosen))
                     + sum(m[f] for m, f in zip(marginal, chosen)))
            if best is None or total < best[0] - 1e-12:
                best = (total, chosen)
    assert best is not None
    compressed = fixed[COMPRESSED] + sum(m[COMPRESSED] for m in marginal)
    return best[1], compressed, best[0]


class Strategy(Stateful):
    """The state and the decisions of ``strategy="auto"`` (module docstring).

    Args:
        warmup_steps: Steps compressed throughout before the first decision: the last
            one's collectives are the ones recorded, so it must come after DDP has settled
            its buckets (after its first step) and the communicator has agreed on the
            payload layout of each (at its first exchange of them).
        recheck_steps: Steps between probes of the link after a decision (0: never).
        margin: The relative change of the link's latency or bandwidth that makes a new
            decision.
        min_saving: The share of a step that a plan must save, over the plan it replaces,
            to be chosen: the method's over fp16 and dense alone, each tensor's cheapest
            form over either (module docstring, step 3).
        step_penalty: The method's steps to a target over a lossless exchange's (at least
            1; ``math.inf``: never compress); a plan that compresses weighs its step by it.

    Attributes:
        forms: Each decided tensor's form (`FORMS`), by name.
        decision: The last decision's rows (`table`), one per bucket.

    Example:
        >>> import torch, gracecomm
        >>> grace = gracecomm.build({"name": "topk", "ratio": 0.5},
        ...                         strategy=gracecomm.Strategy(warmup_steps=1))
        >>> for _ in range(2):  # decided at the start of the second step
        ...     mean = grace.step(torch.tensor([1.0, -3.0]), "w")
        >>> grace.strategy.forms  # one process: no link to spare, so dense
        {'w': 'dense'}
    """

    state_attrs = ("steps", "forms", "link", "step_s", "costs", "recorded", "decided_at",
                   "decision", "decisions", "plan")

    def __init__(self, warmup_steps: int = 3, recheck_steps: int = 500,
                 margin: float = 0.25, min_saving: float = 0.2,
                 step_penalty: float = 1.0) -> None:
        self.warmup_steps = int(check_range(warmup_steps, "strategy", "warmup_steps", 1,
                                            integer=True))
        self.recheck_steps = int(check_range(recheck_steps, "strategy", "recheck_steps", 0,
                                             integer=True))
        self.margin = float(check_range(margin, "strategy", "margin", 0.0, low_open=True))
        self.min_saving = float(check_range(min_saving, "strategy", "min_saving", 0.0, 1.0))
        self.step_penalty = float(check_range(step_penalty, "strategy", "step_penalty", 1.0))
        self.step_s = 0.0  # the last warm-up step's wall time, start to start (agreed)
        self.plan = METHOD  # the last decision's kind of plan (`PLANS`)
        self._started: float | None = None
        self.steps = 0
        self.forms: dict[str, str] = {}
        self.link: list[float] = []  # [latency_s, bandwidth_bps] decided on
        self.costs: dict[str, list[float]] = {}  # TensorCost fields, by name (agreed)
        self.decided_at = -1
        self.decision: list[dict[str, Any]] = []
        self.decisions = 0
        self.buckets: list[tuple[tuple[str, ...], Link]] = []  # the last keeping step's calls
        self._calls: list[tuple[tuple[str, ...], Link]] = []
        self.recorded: list[tuple[list[str], dict[str, list[float]]]] = []  # decided buckets
        self.kept: dict[str, torch.Tensor] = {}  # tensors to time, until they are decided

    def __repr__(self) -> str:
        return (f"Strategy(warmup_steps={self.warmup_steps}, "
                f"recheck_steps={self.recheck_steps}, margin={self.margin}, "
                f"min_saving={self.min_saving}, step_penalty={self.step_penalty})")

    def step_started(self) -> float:
        """Note the start of a step (the pipeline's first call of it).

        Returns:
            The wall time of the last step, start to start (0 before the second).
        """
        now = time.perf_counter()
        last = 0.0 if self._started is None else now - self._started
        self._started = now
        return last

    def forms_of(self, names: Sequence[str]) -> list[str]:
        """Each tensor's form: decided, or compressed (warm-up, or seen since).

        Args:
            names: The tensors' names.

        Returns:
            One of `FORMS` for each.
        """
        return [self.forms.get(name, COMPRESSED) for name in names]

    def keep(self, compensated: Sequence[tuple[str, torch.Tensor]], link: Link) -> None:
        """Keep the undecided tensors of one compressed call and its link (step 1).

        Args:
            compensated: The call's tensors sent compressed, after error feedback.
            link: The link its collectives are recorded on (`Link.recorded`).
        """
        new = [(name, t) for name, t in compensated if name not in self.forms]
        if new:
            self.kept.update((name, t.detach().clone()) for name, t in new)
            self._calls.append((tuple(name for name, _ in compensated), link))

    def end_step(self) -> None:
        """Count a step; the calls of a step that kept tensors are the buckets to decide."""
        self.steps += 1
        if self._calls:
            self.buckets, self._calls = self._calls, []

    def due(self) -> str | None:
        """What the start of this step must do.

        Returns:
            ``"decide"`` (kept tensors, past the warm-up), ``"recheck"`` (the link's probe
            is due), or None.
        """
        if self.steps < self.warmup_steps:
            return None
        if self.kept and self.buckets:
            return "decide"
        if self.recheck_steps and self.link and self.steps - self.decided_at >= self.recheck_steps:
            return "recheck"
        return None

    def largest_bucket_nbytes(self) -> int:
        """The largest bucket's dense bytes, the largest size the link's probe need send.

        Returns:
            The bytes of the largest bucket to decide (its kept tensors) or decided (its
            measured tensors): the sizes the choice prices; 0 with none.
        """
        kept = [sum(self.kept[n].numel() * self.kept[n].element_size()
                    for n in names if n in self.kept) for names, _ in self.buckets]
        decided = [sum(int(self.costs[n][0] * self.costs[n][1]) for n in names
                       if n in self.costs) for names, _ in self.recorded]
        return max(kept + decided, default=0)

    def changed(self, link: Sequence[float]) -> bool:
        """Whether a probed link differs from the decided one by more than `margin`.

        Args:
            link: ``[latency_s, bandwidth_bps]``, probed and agreed.

        Returns:
            True if the latency or the bandwidth moved by more than `margin`.
        """
        return any(abs(new - old) > self.margin * old for new, old in zip(link, self.link))

    def decide(self, link: Sequence[float], costs: dict[str, TensorCost], world: int,
               decompressions: int, step_s: float | None = None) -> None:
        """Choose the forms of every bucket's tensors from agreed measurements (step 3).

        Args:
            link: ``[latency_s, bandwidth_bps]``.
            costs: Every tensor's measurements, by name (the kept ones and earlier ones).
            world: The ranks of the exchange's group.
            decompressions: Decompressions per compressed tensor and rank.
            step_s: The last warm-up step's wall time (None: the one decided on before).
        """
        self.link = list(link)
        if step_s is not None:
            self.step_s = float(step_s)
        self.costs.update({name: [getattr(c, f) for f in TensorCost.__dataclass_fields__]
                           for name, c in costs.items()})
        model = Model(link[0], link[1], world, decompressions)
        plans = []
        for names, recorded in self._recorded_buckets():
            known = [n for n in names if n in self.costs]
            bucket = [TensorCost(*self.costs[n]) for n in known]
            plans.append((known, choose(bucket, recorded, model),
                          choose(bucket, recorded, model, (FP16, DENSE), mix=False)))
        enough = self.min_saving * self.step_s
        method_s, lossless_s, mixed_s = (sum(plan[1][1] for plan in plans),
                                         sum(plan[2][2] for plan in plans),
                                         sum(plan[1][2] for plan in plans))
        rest_s = max(self.step_s - method_s, 0.0)  # the step besides the method's exchange
        weighed = {METHOD: self._weighed(max(self.step_s, method_s), True),
                   LOSSLESS: rest_s + lossless_s,
                   MIXED: self._weighed(rest_s + mixed_s,
                                        any(COMPRESSED in plan[1][0] for plan in plans))}
        base = METHOD if weighed[LOSSLESS] - weighed[METHOD] >= enough else LOSSLESS
        self.plan = MIXED if weighed[base] - weighed[MIXED] >= enough else base
        rows = []
        for index, (known, best, lossless) in enumerate(plans):
            forms, chosen_s = {MIXED: (best[0], best[2]), LOSSLESS: (lossless[0], lossless[2]),
                               METHOD: ([COMPRESSED] * len(known), best[1])}[self.plan]
            self.forms.update(zip(known, forms))
            rows.append({"bucket": index, "tensors": len(known),
                         "bytes": sum(int(self.costs[n][0] * self.costs[n][1]) for n in known),
                         **{form: forms.count(form) for form in FORMS},
                         "compressed_ms": 1e3 * best[1], "lossless_ms": 1e3 * lossless[2],
                         "best_ms": 1e3 * best[2], "chosen_ms": 1e3 * chosen_s})
        self.decision = rows
        self.decided_at = self.steps
        self.decisions += 1
        self.kept = {}
        LOG.info("strategy auto, decision %d:\n%s", self.decisions, self.table())

    def _weighed(self, step_s: float, compresses: bool) -> float:
        """A plan's step weighed by the method's `step_penalty` if it compresses a tensor."""
        if not compresses:
            return step_s
        return math.inf if math.isinf(self.step_penalty) else self.step_penalty * step_s

    def _recorded_buckets(self) -> list[tuple[list[str], dict[str, list[float]]]]:
        """The buckets to decide (`recorded`, with the calls kept since the last decision
        added): their names and the collectives they launched compressed."""
        self.recorded += [(list(names), {k: list(v) for k, v in link.recorded.items()})
                          for names, link in self.buckets]
        self.buckets = []
        return self.recorded

    def table(self) -> str:
        """The last decision as a table.

        Returns:
            One line for the link, then per bucket: its tensors, size, how many tensors go
            in each form, and the modelled time of the bucket compressed throughout and as
            chosen.
        """
        total = {key: sum(row[key] for row in self.decision)
                 for key in ("compressed_ms", "lossless_ms", "best_ms")}
        lines = [f"strategy auto: latency {1e6 * self.link[0]:.0f} us, bandwidth "
                 f"{8e-6 * self.link[1]:.1f} Mbit/s (probed); a {1e3 * self.step_s:.1f} ms "
                 f"step; modelled: the method throughout {total['compressed_ms']:.2f} ms, fp16 "
                 f"and dense {total['lossless_ms']:.2f} ms, mixed {total['best_ms']:.2f} ms: "
                 f"{PLANS[self.plan]} (step_penalty {self.step_penalty:.3g}, min_saving "
                 f"{self.min_saving:g} of the step)",
                 "bucket | tensors | KB     | compressed | fp16 | dense | ms compressed "
                 "| ms chosen"]
        for row in self.decision:
            lines.append(f"{row['bucket']:>6} | {row['tensors']:>7} | {row['bytes'] / 1e3:>6.1f} "
                         f"| {row[COMPRESSED]:>10} | {row[FP16]:>4} | {row[DENSE]:>5} "
                         f"| {row['compressed_ms']:>13.2f} | {row['chosen_ms']:>9.2f}")
        return "\n".join(lines)


def probe(group: Any, device: torch.device, max_nbytes: int = PROBE_MAX_BYTES) -> list[float]:
    """This rank's measurement of the link of `group`: ``[latency_s, bandwidth_bps]`` by
    blocking allreduces (module docstring, step 2), the bandwidth's no larger than
    `max_nbytes` (the largest bucket: the sizes the decision prices); nothing is counted as
    payload."""
    world = dist.get_world_size(group)

    def seconds(nbytes: int, repeats: int) -> float:
        buf = torch.zeros(max(1, nbytes // 4), device=device)
        return timed(lambda: dist.all_reduce(buf, group=group), device, repeats)[0]

    dist.all_reduce(torch.zeros(1, device=device), group=group)  # connections set up
    small = seconds(8, PROBE_REPEATS)
    nbytes, last = PROBE_START_BYTES, max(PROBE_START_BYTES, min(max_nbytes, PROBE_MAX_BYTES))
    while True:
        large = seconds(nbytes, 2)
        if large - small >= PROBE_ENOUGH_S or nbytes >= last:
            break
        nbytes = min(4 * nbytes, last)
    latency = small / (2 * (world - 1))
    return [latency, 2 * (world - 1) / world * nbytes / max(large - small, 1e-9)]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int = 2) -> tuple[float, Any]:
    """The best of `repeats` wall times of `fn` and its last result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best, out


def agree(values: list[float], group: Any, device: torch.device) -> list[float]:
    """The mean of every rank's `values` over `group`, as rank 0 of the group has it (the
    same numbers on every rank, whatever each rank measured)."""
    if dist.get_world_size(group) == 1:
        return list(values)
    buf = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(buf, group=group)
    buf /= dist.get_world_size(group)
    dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group is not None else 0,
                   group=group)
    return buf.tolist()


def measure_costs(kept: dict[str, torch.Tensor], buckets: Sequence[Sequence[str]],
                  compress: Callable[[list[tuple[str, torch.Tensor]]], list[Any]],
                  decompress: Callable[[Any], torch.Tensor],
                  fp16: Callable[[str, torch.Tensor], Any]) -> dict[str, list[float]]:
    """This rank's compute measurements of the kept tensors (module docstring, step 2):
    ``{name: [numel, itemsize, payload bytes, compress_s, decompress_s, fp16_s]}``, where
    `compress` compresses a call's tensors at once, returning (payload, ctx) for each, and
    `fp16` round-trips a tensor. A method that compresses a call's tensors together (PowerSGD
    batches them by shape) costs less than the sum of its calls tensor by tensor: each
    tensor's compression time is scaled so that a bucket's add up to the bucket's own. The
    fp16 form sends a bucket's tensors joined, so their casts are scaled the same way."""
    out = {}
    for name, t in kept.items():
        compress_s, ((payload, ctx),) = timed(lambda n=name, x=t: compress([(n, x)]), t.device)
        decompress_s, _ = timed(lambda p=payload, c=ctx: decompress((p, c)), t.device)
        fp16_s, _ = timed(lambda n=name, x=t: fp16(n, x), t.device)
        out[name] = [t.numel(), t.element_size(), payload_nbytes(payload), compress_s,
                     decompress_s, fp16_s]
    for names in buckets:
        named = [(name, kept[name]) for name in names if name in kept]
        if len(named) < 2:
            continue
        device = named[0][1].device
        _scale_to(out, named, 3, timed(lambda n=named: compress(n), device)[0])
        joint = joined(named)
        if joint is not None:  # the fp16 form sends them joined (`Grace._whole_rounds`)
            _scale_to(out, named, 5, timed(lambda j=joint: fp16(*j), device)[0])
    return out



def _scale_to(out: dict[str, list[float]], named: Sequence[tuple[str, torch.Tensor]],
              column: int, together: float) -> None:
    """Scale the `column` of `named`'s measurements in `out` so that they add up to
    `together`, the time of the tensors at once."""
    alone = sum(out[name][column] for name, _ in named)
    if alone > 0:
        for name, _ in named:
            out[name][column] *= together / alone
