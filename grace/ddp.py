"""A model's gradients through a Grace pipeline: the DDP communication hook, and the same
exchange for custom loops.

    ddp = DistributedDataParallel(model)
    grace = build({"name": "topk", "ratio": 0.01})
    register_comm_hook(ddp, grace, optimizer)     # or, without DDP, after each backward:
    exchange = GradientExchange(grace, model, optimizer); exchange.step()
    state, hook = comm_hook(grace, model)         # for a framework that registers the hook

`comm_hook` is the (state, hook) pair of PyTorch's `DistributedDataParallel.register_comm_hook`
for frameworks that take one and register it themselves; since such a framework may skip it
(Lightning registers comm hooks only on CUDA devices), the first optimizer step that would
update the model checks that the hook has run, and raises instead of letting the model train
on plain averaged gradients.

For each gradient bucket the hook compresses every parameter's gradient separately (its own
k, its own statistics, its own residual keyed by the parameter name; an elementwise
compressor with a memory that keeps nothing takes the bucket as one tensor, with the same
result: `Capabilities.elementwise`) on the backward thread,
launches the bucket's first collective and returns a future, as PyTorch's own hooks do; the
later rounds and the decompression run on the communicator's worker (`gracecomm.exchange`), so a
bucket's communication overlaps with the backward pass of the next buckets. A model of one
bucket has nothing to overlap with: its exchange runs on the backward thread (a hand-over
to the worker cost 1-3 ms per step on a 2-core machine, `gracecomm-netbench`).

What the parts need from the exchange (`gracecomm.needs`) is honoured here: a part that applies
the momentum itself gets its weight decay added before compression and is refused an
optimizer that still has momentum or weight decay; a compressor of whole models (LGC) or a
memory that clips by the norm of all local gradients (DGC) is exchanged once per step, after
the last bucket, with every gradient in the model's parameter order, exactly as
`GradientExchange.step` does in a custom loop.
"""

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gracecomm.exchange import Exchange
from gracecomm.metrics import Metrics
from gracecomm.needs import Need
from gracecomm.pipeline import Grace
from gracecomm.validation import ConfigError, NonFiniteError, check_range

WHOLE_STEP = frozenset({Need.WHOLE_MODEL, Need.GLOBAL_NORM})


def check_optimizer(grace: Grace, optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse an optimizer that would apply a momentum a part of `grace` already applies
    (or weight decay that must come before compression), naming the fix."""
    if Need.OWNS_MOMENTUM not in grace.needs:
        return
    owner = grace.needed_by(Need.OWNS_MOMENTUM)
    fix = ("build it as torch.optim.SGD(params, lr, momentum=0, weight_decay=0) and pass the "
           "weight decay to the exchange (weight_decay=...), which adds it before compression")
    if optimizer is None:
        raise ConfigError(f"{owner} applies the momentum itself, so the optimizer must run "
                          f"without momentum: pass the optimizer to be checked; {fix}")
    for i, group in enumerate(optimizer.param_groups):
        if "momentum" not in group:
            raise ConfigError(f"{owner} applies the momentum itself, but the optimizer "
                              f"{type(optimizer).__name__} keeps moment estimates of its own; "
                              f"{fix}")
        if group["momentum"] or group.get("weight_decay", 0.0):
            raise ConfigError(f"{owner} applies the momentum itself, but optimizer param group "
                              f"{i} has momentum={group['momentum']} and weight_decay="
                              f"{group.get('weight_decay', 0.0)}; {fix}")


def check_scaler(grace: Grace, scaler: torch.amp.GradScaler | None) -> None:
    """With a GradScaler, switch `grace` to pass non-finite steps through (the scaler's
    overflows are deliberate); without one, warn where it already passes them through, the
    combination that trains silently wrong when a GradScaler scales the loss unseen."""
    if scaler is not None:
        if not isinstance(scaler, torch.amp.GradScaler):
            raise ConfigError(f"scaler must be a torch.amp.GradScaler, got "
                              f"{type(scaler).__name__}")
        grace.check_finite = False
    elif not grace.check_finite:
        warnings.warn(
            "the pipeline passes non-finite steps through (check_finite=False) but the "
            "exchange was given no scaler: if a torch.amp.GradScaler scales the loss, pass it "
            "(scaler=scaler), or compression works on loss-scaled gradients and its state "
            "(residuals, momentum, thresholds) is wrong whenever the scale changes; without "
            "a GradScaler, a non-finite step reaches the optimizer as NaN", UserWarning,
            stacklevel=3)


class TailTimer:
    """``comm_s`` of an asynchronous step: the time the training thread waits after the
    step's last bucket hook has returned until its last collective has completed (zero if
    it completed first); communication hidden behind backward is not counted. Either event
    may come first (they happen on different threads)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._marks: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark(self, event: str, when: float) -> None:
        """`event` is ``returned`` or ``communicated``."""
        with self._lock:
            self._marks[event] = when
            if len(self._marks) == 2:
                waited = self._marks.pop("communicated") - self._marks.pop("returned")
                self.metrics.add("comm_s", max(0.0, waited))


class GradientExchange:
    """Every gradient of a model through a `Grace` pipeline once per step, honouring what
    its parts need (module docstring): the DDP hook's state, and the exchange of a custom
    loop (`step`).

    Args:
        grace: The pipeline (`build`).
        model: The model whose parameters' gradients are exchanged (for DDP, its
            ``module``); parameters are named as ``model.named_parameters()`` names them.
        optimizer: The optimizer, checked where a part applies the momentum itself (DGC,
            Signum): it must then run without momentum and weight decay.
        weight_decay: Added to the gradients before compression (times the parameters),
            where a part owns the momentum.
        asynchronous: The hook returns before the bucket's exchange has completed (True),
            or waits for it; both give identical results.
        hierarchy: ``"flat"`` or ``"node"``: the pipeline's ``hierarchy``, set here before
            its first step (`Grace.use_hierarchy`); None keeps the pipeline's.
        scaler: The `torch.amp.GradScaler` of a mixed-precision loop; nothing else is
            needed. Compression then sees the gradients divided by its current scale and
            the means are multiplied back, so the compression state (residuals, momentum,
            clipping thresholds) is in the gradients' own units whatever the loss scale,
            and the pipeline passes the scaler's overflow steps through (its
            ``check_finite`` is switched off: such a step reaches every rank as NaN, the
            scaler skips it and the compression state is restored, `Grace`). A pipeline
            built with ``check_finite=False`` and no scaler is warned about: with a scaler
            the exchange does not know, compression would work in loss-scaled units.

    Raises:
        ConfigError: `grace` is not a `Grace`, `weight_decay` is negative, or the optimizer
            applies a momentum a part already applies (the message names the fix).

    Attributes:
        error: The exception the hook's exchange raised in the current step, of its own
            type (DDP raises a hook's error again as a RuntimeError that only quotes it).

    Example:
        A custom loop without DDP (every rank runs it):

        ```python
        grace = gracecomm.build({"name": "topk", "ratio": 0.01})
        exchange = gracecomm.GradientExchange(grace, model, optimizer)
        for x, y in batches:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            exchange.step()      # every gradient is now the mean over ranks
            optimizer.step()
        ```
    """

    def __init__(self, grace: Grace, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, *, weight_decay: float = 0.0,
                 asynchronous: bool = True, scaler: torch.amp.GradScaler | None = None,
                 hierarchy: str | None = None) -> None:
        if not isinstance(grace, Grace):
            raise ConfigError("the exchange needs a gracecomm.Grace pipeline "
                              f"(gracecomm.build(...)), got {type(grace).__name__}")
        grace.use_hierarchy(hierarchy)
        check_optimizer(grace, optimizer)
        check_scaler(grace, scaler)
        self.grace = grace
        self.weight_decay = float(check_range(weight_decay, "exchange", "weight_decay", 0.0))
        self.asynchronous = bool(asynchronous)
        self.parameters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in self.parameters}
        self.order = {n: i for i, (n, _) in enumerate(self.parameters)}
        self.whole_step = bool(grace.needs & WHOLE_STEP)
        self.scaler = scaler
        self.scale = 1.0  # the scaler's scale during the current step
        self.tail = TailTimer(grace.metrics)
        self.error: BaseException | None = None
        self.hook_calls = 0  # buckets the DDP hook has handed over
        self.expecting: Any = None  # `expect_hook`'s handle until the hook runs
        self._waiting: list[tuple[list[str], list[torch.Tensor], list[torch.Tensor],
                                  dist.GradBucket, torch.futures.Future[torch.Tensor]]] = []

    def prepared(self, names: Sequence[str], grads: Sequence[torch.Tensor],
                 params: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """What the pipeline compresses for each gradient.

        Args:
            names: The parameters' names.
            grads: Their gradients.
            params: The parameters.

        Returns:
            (name, gradient / scale + weight_decay * parameter) for each.
        """
        if self.scale != 1.0:
            grads = [g / self.scale for g in grads]
        if not self.weight_decay:
            return list(zip(names, grads))
        return [(n, g.add(p.detach(), alpha=self.weight_decay))
                for n, g, p in zip(names, grads, params)]

    def begin_step(self) -> None:
        """Read the loss scaler's scale for the step about to be exchanged."""
        self.scale = 1.0 if self.scaler is None else float(self.scaler.get_scale())

    def write(self, grads: Sequence[torch.Tensor], means: Sequence[torch.Tensor]) -> None:
        """Store each mean (times the scale) as its gradient: one pass each, and without a
        scale one call for all.

        Args:
            grads: The gradients, overwritten.
            means: Their means over ranks, in order.
        """
        if self.scale != 1.0:
            for grad, mean in zip(grads, means):
                torch.mul(mean.view_as(grad), self.scale, out=grad)
            return
        pairs = [(g, m.view_as(g)) for g, m in zip(grads, means)
                 if g.data_ptr() != m.data_ptr()]
        if pairs:
            torch._foreach_copy_(*map(list, zip(*pairs)))

    def step(self) -> None:
        """A custom loop's exchange: after backward, replace every gradient by the mean over
        ranks (a parameter without a gradient contributes zeros). Every rank calls it.

        Raises:
            NonFiniteError: A gradient holds NaN or Inf (with ``check_finite``).
            CommunicationError: A peer died or hung past the collective timeout.
        """
        self.begin_step()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for _, p in self.parameters]
        names = [n for n, _ in self.parameters]
        params = [p for _, p in self.parameters]
        self.write(grads, self.grace.step_many(self.prepared(names, grads, params)))
        for p, grad in zip(params, grads):
            p.grad = grad

    # -- the DDP hook ---------------------------------------------------------------------
    def bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The hook's work for one bucket (DDP calls it through `register_comm_hook`).

        Args:
            bucket: DDP's bucket of gradients.

        Returns:
            A future of the bucket's buffer holding the means over ranks.
        """
        self.hook_calls += 1
        if self.expecting is not None:  # `expect_hook`: the hook runs
            self.expecting.remove()
            self.expecting = None
        if bucket.index() == 0:  # DDP hands buckets over in index order
            self.error = None
            self.begin_step()
        try:
            return self._bucket(bucket)
        except BaseException as err:
            self.error = err
            raise

    def _bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        params = bucket.parameters()
        grads = bucket.gradients()
        try:
            names = [self.names[id(p)] for p in params]
        except KeyError:
            raise ConfigError("the DDP model's parameters are not those of the model this "
                              "exchange was made for: pass the module that DDP wraps") from None
        named = self.prepared(names, grads, params)
        if self.whole_step:
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            self._waiting.append((names, grads, [t for _, t in named], bucket, future))
            if bucket.is_last():
                self._exchange_whole_step()
            return future
        buffer = bucket.buffer()
        if (len(grads) > 1 and self.scale == 1.0 and not self.weight_decay
                and buffer.numel() == sum(g.numel() for g in grads)
                and self.grace.sends_whole(names)):
            # the bucket, its gradients back to back, as one tensor: the same result
            exchange = self._start_joined(buffer, named)
            grads = [buffer]
        else:
            exchange = self.grace.start_many(named)
        last = bucket.is_last()

        def write_back(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            try:
                means = done.value()
            except BaseException as err:
                self.error = err
                raise
            if last and exchange.submitted:
                self.tail.mark("communicated", exchange.waited_until)
            self.write(grads, means)
            if last:  # exchanges complete in order: the step's last one ends it
                self.grace.end_step()
            return buffer

        result = exchange.future.then(write_back)
        alone = last and bucket.index() == 0  # a step's only bucket: nothing to overlap with
        if self.asynchronous and not alone:
            exchange.submit()
            if last and exchange.submitted:
                self.tail.mark("returned", time.perf_counter())
        else:
            exchange.wait()
        return result

    def _start_joined(self, buffer: torch.Tensor, named: list[tuple[str, torch.Tensor]]
                      ) -> Exchange:
        """`start_many` of a bucket's buffer as one tensor named after its first gradient;
        a non-finite buffer goes through again gradient by gradient, so that the error
        names the gradient."""
        try:
            exchange = self.grace.start_many([(named[0][0], buffer)])
        except NonFiniteError:
            return self.grace.start_many(named)
        # ``tensors`` counts the bucket's gradients, as the path gradient by gradient does
        self.grace.metrics.add("tensors", len(named) - 1)
        return exchange

    def _exchange_whole_step(self) -> None:
        """At the last bucket: exchange every waiting gradient in one call, in the model's
        parameter order, and complete every waiting bucket's future."""
        waiting, self._waiting = self._waiting, []
        entries = sorted(((n, t) for names, _, tensors, _, _ in waiting
                          for n, t in zip(names, tensors)), key=lambda e: self.order[e[0]])
        try:
            means = dict(zip((n for n, _ in entries), self.grace.step_many(entries)))
        except BaseException as err:
            for *_, future in waiting:
                future.set_exception(err)
            raise
        for names, grads, _, bucket, future in waiting:
            self.write(grads, [means[name] for name in names])
            future.set_result(bucket.buffer())


def grace_hook(state: GradientExchange,
               bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook (see module docstring). The annotations are real objects,
    not strings: DDP inspects them when the hook is registered."""
    return state.bucket(bucket)


Hook = Callable[[GradientExchange, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def comm_hook(grace: Grace, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
              *, weight_decay: float = 0.0, asynchronous: bool = True,
              scaler: torch.amp.GradScaler | None = None,
              hierarchy: str | None = None) -> tuple[GradientExchange, Hook]:
    """The (state, hook) pair for a framework that registers DDP communication hooks itself
    (``DistributedDataParallel.register_comm_hook(state, hook)``, Lightning's
    ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)``). The options are
    `GradientExchange`'s; `model` is the module DDP will wrap (its parameter names key the
    compression state).

    A framework may skip a hook it was given (Lightning registers comm hooks only on CUDA),
    or run the model without DDP (one process): the first optimizer step over `model`'s
    parameters then raises `ConfigError` if the hook has not run, before any parameter is
    updated with uncompressed gradients.

    Args:
        grace: The pipeline (`build`).
        model: The module the framework wraps in `DistributedDataParallel`.
        optimizer: The optimizer, checked where a part applies the momentum itself.
        weight_decay: Added to the gradients before compression.
        asynchronous: Overlap each bucket's exchange with the rest of backward (True).
        scaler: The `torch.amp.GradScaler` of a mixed-precision loop (`GradientExchange`).
        hierarchy: ``"flat"`` or ``"node"`` (`GradientExchange`); None keeps the pipeline's.

    Returns:
        The hook's state (a `GradientExchange`) and the hook (`grace_hook`).

    Raises:
        ConfigError: The optimizer or scaler is refused (at once), or the hook has not run
            by the first optimizer step.

    Example:
        ```python
        state, hook = gracecomm.comm_hook(gracecomm.build("fp16"), model, optimizer)
        DistributedDataParallel(model).register_comm_hook(state, hook)
        ```
    """
    state = GradientExchange(grace, model, optimizer, weight_decay=weight_decay,
                             asynchronous=asynchronous, scaler=scaler, hierarchy=hierarchy)
    expect_hook(state)
    return state, grace_hook


def expect_hook(state: GradientExchange) -> None:
    """Until the DDP hook has run, raise `ConfigError` at any optimizer step that would
    update a parameter of `state`'s model (`comm_hook`), before the update: where the step
    is given a closure (Lightning's), once the closure has run backward. The first call of
    the hook removes the check."""
    ref = weakref.ref(state)

    def verify(optimizer: torch.optim.Optimizer) -> None:
        exchange = ref()
        if exchange is not None and exchange.hook_calls == 0:
            raise ConfigError(
                f"{type(optimizer).__name__} is about to take a step, but the gracecomm hook "
                "has not run: the model's gradients were averaged without compression. The "
                "hook was not registered on the DistributedDataParallel model that computed "
                "them: a framework skipped it (Lightning's DDPStrategy registers comm hooks "
                "only on CUDA devices: use gracecomm.lightning.GraceStrategy), or the model "
                "runs without DDP (one process). Register it on the DDP model: "
                "gracecomm.register_comm_hook(ddp_model, grace, optimizer)")

    def check(optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        exchange = ref()
        if exchange is None or not any(id(p) in exchange.names for group in
                                       optimizer.param_groups for p in group["params"]):
            return None  # another model's optimizer
        # args: the step's positional arguments, the optimizer first, then the closure
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            verify(optimizer)
            return None

        def checked() -> Any:
            loss = closure()
            verify(optimizer)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": checked}
        return (args[0], checked, *args[2:]), kwargs

    # removed by the hook's first call, never inside the optimizer's loop over its hooks
    state.expecting = register_optimizer_step_pre_hook(check)


def register_comm_hook(model: DistributedDataParallel, grace: Grace,
                       optimizer: torch.optim.Optimizer | None = None, *,
                       weight_decay: float = 0.0, asynchronous: bool = True,
                       scaler: torch.amp.GradScaler | None = None,
                       hierarchy: str | None = None) -> GradientExchange:
    """Make a DDP model exchange its gradients through a `Grace` pipeline.

    The hook is asynchronous, like PyTorch's own: each bucket's exchange overlaps with the
    backward pass of the next buckets (module docstring).

    Args:
        model: The `DistributedDataParallel` model (after a framework's wrapping:
            Accelerate's ``prepare``).
        grace: The pipeline (`build`).
        optimizer: The optimizer, checked where a part applies the momentum itself.
        weight_decay: Added to the gradients before compression, where a part owns the
            momentum.
        asynchronous: Overlap each bucket's exchange with the backward pass (True).
        scaler: A mixed-precision loop's `torch.amp.GradScaler`: enough to pass its
            overflow steps through (see `GradientExchange`).
        hierarchy: ``"node"``: reduce dense inside each node and compress only what
            crosses nodes (`gracecomm.hierarchy`); ``"flat"``; None keeps the pipeline's.

    Returns:
        The hook's state, a `GradientExchange` (its ``error`` holds the exchange's error
        of its own type after a failed step).

    Raises:
        TypeError: `model` is not a `DistributedDataParallel` model.
        ConfigError: As `GradientExchange` (the optimizer or scaler is refused).

    Example:
        ```python
        ddp = DistributedDataParallel(model)
        grace = gracecomm.build({"name": "topk", "ratio": 0.01})
        gracecomm.register_comm_hook(ddp, grace, optimizer)
        loss_fn(ddp(x), y).backward()   # gradients are exchanged compressed
        ```
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"register_comm_hook needs a DistributedDataParallel model, got "
                        f"{type(model).__name__}: the hook would never run and the model "
                        "would train on uncompressed gradients. Wrap it first (a framework "
                        "that runs one process wraps nothing), or use "
                        "GradientExchange(grace, model, optimizer).step() after backward")
    state = GradientExchange(grace, model.module, optimizer, weight_decay=weight_decay,
                             asynchronous=asynchronous, scaler=scaler, hierarchy=hierarchy)
    model.register_comm_hook(state, grace_hook)
    return state
