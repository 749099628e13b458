"""The Grace pipeline: memory -> compressor -> communicator for each tensor.

    g --Memory.compensate--> t --Compressor.compress--> (payload, ctx)
      Memory.update(t, name, compressor, payload, ctx)
    payload --Communicator exchange--> mean over ranks (dense)

Use `build` to assemble one from names, dicts, Hydra configs or instances.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch

from gracecomm.communicator import Communicator
from gracecomm.compressor import Compressor, Payload
from gracecomm.config import instantiate
from gracecomm.exchange import Exchange, Link, Rounds, Works, together
from gracecomm.hierarchy import FLAT, NODE, NodeLayout, assign_owners, check_hierarchy
from gracecomm.memory import Memory
from gracecomm.metrics import Metrics
from gracecomm.needs import Need
from gracecomm.registry import COMMUNICATORS, COMPRESSORS, MEMORIES, Registry
from gracecomm.state import Stateful
from gracecomm.strategy import (
    AUTO as AUTO_STRATEGY,
)
from gracecomm.strategy import (
    CODECS,
    COMPRESSED,
    DENSE,
    FIXED,
    FORMS,
    FP16,
    Strategy,
    TensorCost,
    agree,
    check_strategy,
    measure_costs,
    probe,
)
from gracecomm.validation import (
    ConfigError,
    IncompatibleError,
    NonFiniteError,
    PayloadError,
    check_tensor,
    is_finite,
    nonfinite_among,
)
from gracecomm.wire import contiguous_runs, flat_run, split_like
from gracecomm.wire import joined as joined_tensor

MODEL_ITEM = "model"  # the name of the joint item of a model-level compressor


def max_payload_nbytes(dense: int) -> int:
    """The most payload bytes a peer may announce for an exchange of `dense` bytes of
    gradients (`Link.max_nbytes`): four times them, plus a fixed 64 KiB."""
    return 4 * dense + 65536

Named = Sequence[tuple[str, torch.Tensor]]


class Grace(Stateful):
    """One compressor, one memory and one communicator sharing one `Metrics`.

    Non-finite gradients: with `check_finite` (the default) a gradient holding NaN or Inf
    raises `NonFiniteError` naming the tensor, instead of letting a compressor drop or spread
    it silently. Without it (runs with a `torch.amp.GradScaler`, which overflows on purpose)
    a step where any rank's gradient is non-finite passes through: every rank receives NaN
    for the tensors of that exchange, so the scaler skips the step on every rank, and the
    compression state (residuals, momentum, PowerSGD's Q, SIDCo's stages, LGC's autoencoder,
    random streams) is restored to what it was before the step, so the next finite step goes
    on from there. A step is one `step_many` call, or one DDP step of the hook.

    `needs` is what the parts need from the exchange (`gracecomm.needs`): `step_many` gives
    a memory that needs it the norm of the tensors of its call, and `GradientExchange` (the
    DDP hook and custom loops) takes care of the rest.

    `state_dict` holds everything needed to resume bit-identically: the three parts' states
    (plain tensors and Python values; loadable with ``weights_only=True``) and the node
    layout they were written on (``layout``: hierarchy, nodes, ranks_per_node).

    With ``hierarchy="node"`` the exchange has two levels (`gracecomm.hierarchy`): dense
    inside a node, compressed once per node across nodes, each rank compressing (and keeping
    the error feedback of) the share of the tensors it owns. The node layout is gathered
    once, when the pipeline is built if the default process group is initialised, else at
    the first step (or `state_dict`): every rank must get there at the same point. One rank
    per node, or one node, is the flat exchange.

    With ``strategy="auto"`` each tensor is sent compressed, in fp16 or dense, whichever
    the cost model says is fastest with this run's own measurements of the link and of the
    compression (`gracecomm.strategy`); ``"fixed"`` compresses every tensor.

    Most users build one with `build`; the constructor takes instances.

    Args:
        compressor: The compressor (`Compressor`).
        memory: The memory around it (`Memory`), checked against the compressor.
        communicator: The communicator that carries its payloads (`Communicator`).
        check_finite: Raise `NonFiniteError` on a non-finite tensor (True), or pass
            non-finite steps through (False; see above).
        hierarchy: ``"flat"`` (every rank compresses everything) or ``"node"`` (two
            levels, see above).
        strategy: ``"fixed"``, ``"auto"`` (see above) or a `gracecomm.strategy.Strategy`
            with options of its own.

    Raises:
        ConfigError: A part is not an instance of its role's base class, `hierarchy` or
            `strategy` is unknown, a part cannot run two-level (`check_two_level`) or
            per tensor (`check_auto`), or the nodes have different numbers of ranks.
        IncompatibleError: The memory or the communicator cannot work with the compressor
            (e.g. allreduce with Top-k, whose payloads cannot be summed).

    Attributes:
        compressor: The pipeline's compressor.
        memory: The pipeline's memory.
        communicator: The pipeline's communicator.
        metrics: The statistics the three parts share (`Metrics`); ``metrics.pop()`` returns
            and clears one step's.

    Example:
        >>> import torch
        >>> from gracecomm import Grace, create
        >>> grace = Grace(create("compressor", "topk", ratio=0.1), create("memory", "residual"),
        ...               create("communicator", "allgather"))
        >>> grace.step(torch.arange(10.0), "w")  # one process: the mean of one rank
        tensor([0., 0., 0., 0., 0., 0., 0., 0., 0., 9.])
    """

    child_attrs = ("compressor", "memory", "communicator", "strategy")

    def __init__(self, compressor: Compressor, memory: Memory, communicator: Communicator,
                 *, check_finite: bool = True, hierarchy: str = FLAT,
                 strategy: str | Strategy = FIXED) -> None:
        for obj, base, what in ((compressor, Compressor, "compressor"), (memory, Memory, "memory"),
                                (communicator, Communicator, "communicator")):
            if not isinstance(obj, base):
                raise ConfigError(f"{what} must be a {base.__module__}.{base.__name__}, "
                                  f"got {type(obj).__name__}")
        self.compressor = compressor
        self.memory = memory
        self.communicator = communicator
        self.check_finite = bool(check_finite)
        self.hierarchy = check_hierarchy(hierarchy)
        self.metrics = Metrics()
        self._before_step: dict[str, Any] | None = None  # the state to restore (pass-through)
        self._nonfinite_step = False
        memory.check(compressor)
        communicator.attach(compressor)
        for part in (communicator, compressor, memory):
            part.bind(communicator, self.metrics)
        self._layout: NodeLayout | None = None
        self._owners: dict[str, int] = {}  # the local rank that compresses each tensor
        self._owner_load: list[int] = []  # the elements each local rank owns
        self.strategy: Strategy | None = None
        self._codecs: dict[str, tuple[Compressor, Communicator]] = {}
        self._in_step = False  # between a step's first `start_many` and its `end_step`
        if isinstance(strategy, Strategy) or check_strategy(strategy) == AUTO_STRATEGY:
            self.check_auto()
            self.strategy = strategy if isinstance(strategy, Strategy) else Strategy()
            self._codecs = {form: self._codec(name) for form, name in CODECS.items()}
        if self.hierarchy == NODE:
            self.check_two_level()
            self.node_layout()  # now, if the process group is initialised
        compressor.warm_up()  # its kernels are loaded now, not in the first step

    def __repr__(self) -> str:
        return (f"Grace(compressor={self.compressor.registry_name!r}, "
                f"memory={self.memory.registry_name!r}, "
                f"communicator={self.communicator.registry_name!r}"
                + (f", hierarchy={self.hierarchy!r}" if self.hierarchy != FLAT else "")
                + (f", strategy={AUTO_STRATEGY!r})" if self.strategy is not None else ")"))

    def check_auto(self) -> None:
        """Refuse the parts that cannot be chosen per tensor (``strategy="auto"``).

        Raises:
            ConfigError: The compressor compresses the whole model in one payload, or the
                memory cannot follow a tensor sent in fp16 or dense (its reason given).
        """
        if self.compressor.capabilities().model_level:
            raise ConfigError(f"strategy 'auto' chooses the form of each tensor, but "
                              f"{self.compressor.label} compresses the whole model in one "
                              "payload; use strategy=fixed")
        for name in CODECS.values():
            try:
                self.memory.check(COMPRESSORS.create(name))
            except IncompatibleError as err:
                raise ConfigError(f"strategy 'auto' sends some tensors in fp16 or dense, which "
                                  f"{self.memory.label} cannot follow: {err}; use "
                                  "strategy=fixed") from None

    def _codec(self, name: str) -> tuple[Compressor, Communicator]:
        """The compressor `name` (``fp16``, ``none``) on an allreduce of its own, recording
        into this pipeline's metrics: how ``strategy="auto"`` sends a tensor uncompressed."""
        compressor, communicator = COMPRESSORS.create(name), COMMUNICATORS.create("allreduce")
        communicator.attach(compressor)
        for part in (communicator, compressor):
            part.bind(communicator, self.metrics)
        return compressor, communicator
    def check_two_level(self) -> None:
        """Refuse the parts that cannot run ``hierarchy="node"``, before any step.

        Raises:
            ConfigError: A part needs the norm of all local gradients (each rank compresses
                only its share of the node's mean), or the communicator runs on a process
                group of its own (the two levels' groups are made from the default group).
        """
        if Need.GLOBAL_NORM in self.needs:
            raise ConfigError(f"{self.needed_by(Need.GLOBAL_NORM)} clips by the norm of all "
                              "local gradients, which no rank has with hierarchy 'node' (each "
                              "compresses its share of the node's mean); use hierarchy=flat, "
                              "or clip_scope=tensor")
        if self.communicator.group is not None:
            raise ConfigError(f"{self.communicator.label} runs on a process group of its own, "
                              "but hierarchy 'node' makes its groups from the default group; "
                              "leave its group unset or use hierarchy=flat")

    def use_hierarchy(self, hierarchy: str | None) -> None:
        """Set the ``hierarchy`` option of a built pipeline before its first step (the DDP
        hook's and the frameworks' option; None keeps the pipeline's).

        Args:
            hierarchy: ``"flat"``, ``"node"`` or None.

        Raises:
            ConfigError: An unknown value, a part that cannot run two-level, or a pipeline
                whose node layout is already gathered with another hierarchy.
        """
        if hierarchy is None or check_hierarchy(hierarchy) == self.hierarchy:
            return
        if self._layout is not None:
            raise ConfigError(f"the pipeline already runs with hierarchy {self.hierarchy!r} "
                              f"({self._layout.shape}); build it with hierarchy={hierarchy}")
        if hierarchy == NODE:
            self.check_two_level()
        self.hierarchy = hierarchy
        self.node_layout()

    def node_layout(self) -> NodeLayout | None:
        """The node layout of ``hierarchy="node"`` (gathered on first use: a collective, see
        the class docstring), or None: the flat exchange (``hierarchy="flat"``, no process
        group, or the layout has one level). The communicator then runs on this rank's
        cross-node group.

        Returns:
            The `gracecomm.hierarchy.NodeLayout` where the exchange has two levels.
        """
        if self.hierarchy == FLAT or not self.communicator.distributed:
            return None
        if self._layout is None:
            self._layout = NodeLayout(self.metrics)
            if self._layout.two_level:
                self.communicator.group = self._layout.cross_group
                self._owner_load = [0] * self._layout.ranks_per_node
        return self._layout if self._layout.two_level else None

    def layout_state(self) -> dict[str, Any]:
        """The node layout as `state_dict` records it: ``hierarchy``, ``nodes`` and
        ``ranks_per_node`` (None for the flat exchange, which does not gather them), and
        the two-level exchange's ``owners`` of tensors (`_pieces`) in `state_dict`.

        Returns:
            ``{"hierarchy": ..., "nodes": ..., "ranks_per_node": ...}``.
        """
        self.node_layout()
        layout = self._layout
        return {"hierarchy": self.hierarchy,
                "nodes": None if layout is None else layout.nodes,
                "ranks_per_node": None if layout is None else layout.ranks_per_node}

    def state_dict(self) -> dict[str, Any]:
        """The parts' states and the node layout (class docstring).

        Returns:
            A nested dict of tensors and plain Python values.
        """
        return {**super().state_dict(), "layout": self.layout_state(),
                "owners": dict(self._owners), "owner_load": list(self._owner_load)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s output (one without ``layout``, written before it was
        recorded, is of the flat exchange).

        Args:
            state: A state dict of a pipeline of the same parts.

        Raises:
            ConfigError: It was written with another hierarchy or node shape: each rank's
                state covers the tensors it compressed (the message names both).
        """
        saved = dict(state.get("layout", {"hierarchy": FLAT, "nodes": None,
                                          "ranks_per_node": None}))
        here = self.layout_state()
        if saved != here:
            raise ConfigError(f"the compression state was written with {layout_text(saved)}, "
                              f"this pipeline runs with {layout_text(here)}: each rank's "
                              "state covers the tensors it compressed; resume with the same "
                              "hierarchy and node shape")
        super().load_state_dict(state)
        self._owners = dict(state.get("owners", {}))
        self._owner_load = list(state.get("owner_load", self._owner_load))

    @property
    def needs(self) -> frozenset[Need]:
        """What the compressor and the memory need from the exchange (`gracecomm.needs`)."""
        return self.compressor.needs() | self.memory.needs()

    def needed_by(self, need: Need) -> str:
        """The labels of the parts that need `need`, for messages.

        Args:
            need: One requirement (`Need`).

        Returns:
            ``"compressor 'dgc' and memory 'dgc'"``, or ``""`` if no part needs it.
        """
        return " and ".join(part.label for part in (self.compressor, self.memory)
                            if need in part.needs())

    def step(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Compress one tensor, exchange it and return the mean over ranks: one step.

        Every rank must call it with the same names in the same order.

        Args:
            tensor: A floating-point tensor (a gradient), on any device.
            name: Its name, which keys per-tensor state (the residual, PowerSGD's Q).

        Returns:
            The mean over ranks, of `tensor`'s shape and dtype.

        Raises:
            NonFiniteError: `tensor` holds NaN or Inf and the pipeline checks
                (``check_finite``).
            TypeError: `tensor` is not a floating-point tensor (the message names it).
            PayloadError: A peer's payload is malformed.
            CommunicationError: A peer died or hung past the collective timeout.

        Example:
            >>> import torch, gracecomm
            >>> grace = gracecomm.build("fp16")
            >>> grace.step(torch.tensor([0.5, -2.0]), "w")
            tensor([ 0.5000, -2.0000])
        """
        return self.step_many([(name, tensor)])[0]

    def step_many(self, named: Named) -> list[torch.Tensor]:
        """`step` for several tensors, exchanged in as few collectives as the communicator
        allows; one step (see the class docstring).

        Pass every gradient of a step in one call where the parts need the whole model or
        the global norm (`needs`).

        Args:
            named: (name, tensor) pairs, in the same order on every rank.

        Returns:
            The mean over ranks of each tensor, in order, of its shape and dtype.

        Raises:
            NonFiniteError: A tensor holds NaN or Inf (with ``check_finite``).
            PayloadError: A peer's payload is malformed.
            CommunicationError: A peer died or hung past the collective timeout.

        Example:
            >>> import torch, gracecomm
            >>> grace = gracecomm.build({"name": "topk", "ratio": 0.5})
            >>> means = grace.step_many([("w", torch.tensor([1.0, -3.0])),
            ...                          ("b", torch.tensor([0.25, 0.0]))])
            >>> torch.cat(means).tolist()  # Top-k kept -3.0 of w and 0.25 of b
            [0.0, -3.0, 0.25, 0.0]
        """
        means = self.start_many(named).wait()
        self.end_step()
        return means

    def start_many(self, named: Named) -> Exchange:
        """Compress `named` on this thread and launch their exchange, without waiting.

        ``wait()`` on the result returns the means (in order, same shapes and dtypes) and
        ``submit()`` lets the later rounds run on the communicator's worker while this
        thread goes on (`gracecomm.exchange`). The call is part of the current step until
        `end_step` (`step_many` is ``start_many(named).wait()`` then ``end_step()``).

        Args:
            named: (name, tensor) pairs, in the same order on every rank.

        Returns:
            The started `gracecomm.exchange.Exchange`.

        Raises:
            NonFiniteError: A tensor holds NaN or Inf (with ``check_finite``).
        """
        metrics = self.metrics
        for name, grad in named:
            check_tensor(grad, name)
            if grad.is_cuda:
                metrics.sync_cuda = True
        dense = sum(g.numel() * g.element_size() for _, g in named)
        metrics.add("dense_bytes", dense)
        metrics.add("tensors", len(named))
        layout = self.node_layout()
        if not self._in_step:
            self._in_step = True
            if self.strategy is not None and named:
                self._strategy_start(named[0][1].device, self.strategy.step_started())
        if not self.check_finite and self._before_step is None:
            self._before_step = snapshot(self.state_dict())
        if Need.GLOBAL_NORM in self.memory.needs():
            norms = torch.stack([torch.linalg.vector_norm(g.float()) for _, g in named])
            self.memory.set_local_norm(float(torch.linalg.vector_norm(norms)))
        # detached: no state a part keeps may hold an autograd graph
        live = [(name, grad.detach().contiguous()) for name, grad in named if grad.numel()]
        if live:
            metrics.add("exchanges", 1)  # the dense-allreduce baseline of gracecomm.network
        link = self.communicator.link()
        names = [name for name, _ in live]

        def merge(means: list[torch.Tensor]) -> list[torch.Tensor]:
            received = iter(means)  # an empty tensor has the same shape on every rank
            return [next(received) if grad.numel() else grad.clone() for _, grad in named]

        forms = {}
        for form, (_, comm) in self._codecs.items():
            comm.group = self.communicator.group  # the cross-node group, two-level
            forms[form] = comm.link()
        if layout is not None:
            node = layout.node_comm.link(None if self.check_finite else False)
            return Exchange(self.communicator,
                            self._two_level_rounds(live, layout, node, link, forms),
                            [node, link, *forms.values()], names, merge, layout.continuations)
        link.max_nbytes = max_payload_nbytes(dense)
        return Exchange(self.communicator, self._compressed_rounds(live, link, forms),
                        [link, *forms.values()], names, merge)

    def _strategy_start(self, device: torch.device, step_s: float) -> None:
        """At a step's first call, before any of its collectives: the decision or the probe
        of the link that ``strategy="auto"`` is due (`gracecomm.strategy`), collectively on
        the exchange's group (every rank of it gets here at the same step); `step_s` is the
        last step's wall time on this rank."""
        strategy = self.strategy
        assert strategy is not None
        due = strategy.due()
        if due is None:
            return
        comm = self.communicator
        world = comm.world_size if comm.distributed else 1
        decompressions = ((1 if comm.sums_payloads else world)
                          + (0 if self.memory.identity else 1))
        with self.metrics.timer("decide_s"):
            link = (probe(comm.group, device, strategy.largest_bucket_nbytes()) if world > 1
                    else [0.0, math.inf])
            if due == "recheck":
                link = agree(link, comm.group, device) if world > 1 else link
                if strategy.changed(link):
                    strategy.decide(link, {}, world, decompressions)
                else:
                    strategy.decided_at = strategy.steps
                return
            costs = self._measure_costs(strategy.kept)
            names = list(costs)
            values = [*link, step_s, *(v for name in names for v in costs[name])]
            if world > 1:
                values = agree(values, comm.group, device)
            width = len(TensorCost.__dataclass_fields__)
            agreed = {name: TensorCost(int(values[3 + width * i]), int(values[4 + width * i]),
                                       *values[5 + width * i:3 + width * (i + 1)])
                      for i, name in enumerate(names)}
            strategy.decide(values[:2], agreed, world, decompressions, values[2])
        self.metrics.add("decisions", 1)

    def _measure_costs(self, kept: Mapping[str, torch.Tensor]) -> dict[str, list[float]]:
        """This rank's compute measurements of `kept` (`gracecomm.strategy.measure_costs`),
        the compressor's state and statistics left as they were."""
        assert self.strategy is not None
        saved = snapshot(self.compressor.state_dict())
        self.compressor.bind(self.communicator, Metrics())
        fp16 = self._codecs[FP16][0]

        def compress(named: list[tuple[str, torch.Tensor]]) -> list[Any]:
            # without a link, no round launches a collective
            return self.communicator.run_now(self.compressor.compress_rounds(named, None))

        try:
            return measure_costs(kept, [names for names, _ in self.strategy.buckets], compress,
                                 lambda item: self.compressor.decompress(*item),
                                 lambda name, t: fp16.decompress(*fp16.compress(t, name)))
        finally:
            self.compressor.load_state_dict(saved)
            self.compressor.bind(self.communicator, self.metrics)

    def _compressed_rounds(self, grads: Named, link: Link,
                           forms: Mapping[str, Link] | None = None) -> Rounds:
        """Memory compensation, the finiteness check and the rounds that compress and
        exchange `grads` through `link` (`_method_rounds`; with ``strategy="auto"``,
        `_chosen_rounds`, the other forms through `forms`' links), whose non-finite
        statuses are set here where non-finite steps pass through."""
        with self.metrics.timer("memory_s"):
            compensated = self.memory.compensate_many(grads)
        runs = contiguous_runs([t for _, t in compensated])
        finite = self._finite(grads, compensated, runs)
        if not finite:  # compressed as zeros; the step's state is restored at `end_step`
            compensated = [(name, torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0))
                           for name, t in compensated]
            runs = [range(i, i + 1) for i in range(len(compensated))]
        for each in (link, *(forms or {}).values()):
            each.nonfinite = None if self.check_finite else not finite
            each.max_nbytes = link.max_nbytes
        if self.strategy is not None:
            return (yield from self._chosen_rounds(compensated, link, forms or {}))
        return (yield from self._method_rounds(compensated, runs, link))

    def _method_rounds(self, compensated: Named, runs: Sequence[range], link: Link) -> Rounds:
        """The method's rounds for compensated tensors: `_model_rounds`, `_run_rounds` (for
        `runs` of tensors back to back in memory) or `_rounds`."""
        if self.compressor.capabilities().model_level:
            return (yield from self._model_rounds(compensated, link))
        if self.joins_runs:
            return (yield from self._run_rounds(compensated, runs, link))
        return (yield from self._rounds(compensated, link))

    def _chosen_rounds(self, compensated: Named, link: Link, forms: Mapping[str, Link]
                       ) -> Rounds:
        """``strategy="auto"``: each tensor sent in its form (`gracecomm.strategy`), the
        compressed ones by the method through `link` (and kept for the next decision while
        undecided), the others joined per form (`_rounds`) by their codec's allreduce
        through `forms`' links, all forms' rounds side by side."""
        assert self.strategy is not None
        chosen = self.strategy.forms_of([name for name, _ in compensated])
        groups = {form: [i for i, f in enumerate(chosen) if f == form] for form in FORMS}
        compressed = [compensated[i] for i in groups[COMPRESSED]]
        self.strategy.keep(compressed, link)
        rounds = []
        for form, idx in groups.items():
            part = [compensated[i] for i in idx]
            if not part:
                continue
            if form == COMPRESSED:
                rounds.append(self._method_rounds(
                    part, contiguous_runs([t for _, t in part]), link))
            else:
                rounds.append(self._whole_rounds(part, forms[form], form))
        results = yield from together(rounds)
        out: list[torch.Tensor] = [compensated[0][1]] * len(compensated)
        for idx, means in zip((idx for idx in groups.values() if idx), results):
            for i, mean in zip(idx, means):
                out[i] = mean
        return out

    def _pieces(self, grads: Named, per_node: int
                ) -> tuple[Named, list[int], Callable[[list[torch.Tensor]], list[torch.Tensor]]]:
        """What the two-level exchange compresses, who owns each piece, and how the pieces'
        means make the tensors' means again.

        A compressor of whole models is one piece, owned by local rank 0. Where the pipeline
        joins tensors back to back in memory (`joins_runs`: an elementwise compressor, a
        memory that keeps nothing) each run is cut into `per_node` near-equal pieces, one
        per local rank: a dense reduce-scatter. Otherwise each tensor is a piece, owned for
        good by the local rank it was first given to (`assign_owners` against the elements
        owned so far, recorded in `state_dict`), so that its error feedback stays with it
        whatever the exchanges it comes in (DDP rebuilds its buckets after the first step).
        """
        if self.compressor.capabilities().model_level:
            return grads, [0] * len(grads), lambda means: means
        if not self.joins_runs:
            for name, grad in grads:
                if name not in self._owners:
                    owner = assign_owners([grad.numel()], per_node, self._owner_load)[0]
                    self._owners[name] = owner
                    self._owner_load[owner] += grad.numel()
            return grads, [self._owners[name] for name, _ in grads], lambda means: means
        runs = contiguous_runs([t for _, t in grads])
        pieces: list[tuple[str, torch.Tensor]] = []
        owners: list[int] = []
        for run in runs:
            flat = flat_run([grads[i][1] for i in run]).reshape(-1)
            size, extra = divmod(flat.numel(), per_node)
            cuts = flat.split([size + (j < extra) for j in range(per_node)])
            kept = [j for j in range(per_node) if cuts[j].numel()]
            pieces += [(f"{grads[run.start][0]}/{j}", cuts[j]) for j in kept]
            owners += kept

        def join(means: list[torch.Tensor]) -> list[torch.Tensor]:
            out, pos = [], 0
            for run in runs:
                count = min(per_node, sum(grads[i][1].numel() for i in run))
                flat = torch.cat([m.reshape(-1) for m in means[pos:pos + count]])
                pos += count
                out += [part.view_as(grads[i][1]) for i, part in
                        zip(run, flat.split([grads[i][1].numel() for i in run]))]
            return out

        return pieces, owners, join

    def _two_level_rounds(self, grads: Named, layout: NodeLayout, node: Link, cross: Link,
                          forms: Mapping[str, Link]) -> Rounds:
        """The two-level exchange of `grads` (`gracecomm.hierarchy`): each piece
        (`_pieces`) reduced to its owner inside the node (one buffer per owner and dtype),
        the owner's node means compressed and exchanged across nodes through `cross`
        (`_compressed_rounds`), and the means broadcast from their owners inside the node;
        where non-finite steps pass through, the node also sums its ranks' non-finite
        statuses, so that every rank of every node restores its state."""
        if not grads:
            return []
        per_node = layout.ranks_per_node
        tensors, owners, join = self._pieces(grads, per_node)
        grads = tensors
        shards: dict[tuple[int, torch.dtype], list[int]] = {}
        for i, owner in enumerate(owners):
            shards.setdefault((owner, grads[i][1].dtype), []).append(i)
        buffers = {key: torch.cat([grads[i][1].reshape(-1) for i in idx])
                   for key, idx in shards.items()}
        yield [node.reduce(buf, owner) for (owner, _), buf in buffers.items()]
        owned: dict[int, torch.Tensor] = {}
        for key, idx in shards.items():
            if key[0] == layout.local_rank:
                parts = buffers[key].div_(per_node).split([grads[i][1].numel() for i in idx])
                owned.update((i, p.view_as(grads[i][1])) for i, p in zip(idx, parts))
        mine = sorted(owned)
        cross.max_nbytes = max_payload_nbytes(sum(t.numel() * t.element_size()
                                                  for t in owned.values()))
        means = yield from self._compressed_rounds([(grads[i][0], owned[i]) for i in mine],
                                                   cross, forms)
        mean_of = dict(zip(mine, means))
        for key, idx in shards.items():
            buffers[key] = (torch.cat([mean_of[i].reshape(-1) for i in idx])
                            if key[0] == layout.local_rank else torch.empty_like(buffers[key]))
        works = [node.broadcast(buf, owner) for (owner, _), buf in buffers.items()]
        status = torch.tensor([int(cross.any_nonfinite)], dtype=torch.int32,
                              device=grads[0][1].device)
        if node.status:
            works.append(node.all_reduce(status))
        yield works
        if int(status):
            return join(self._nonfinite(grads))
        out: dict[int, torch.Tensor] = {}
        for key, idx in shards.items():
            parts = buffers[key].split([grads[i][1].numel() for i in idx])
            out.update((i, p.view_as(grads[i][1])) for i, p in zip(idx, parts))
        return join([out[i] for i in range(len(grads))])

    @property
    def joins_runs(self) -> bool:
        """Whether tensors that lie back to back in memory are compressed and exchanged as
        one: an elementwise compressor with a memory that keeps nothing. A DDP bucket can
        then be passed whole, with the same result."""
        caps = self.compressor.capabilities()
        return not caps.model_level and self.memory.identity and caps.elementwise

    def sends_whole(self, names: Sequence[str]) -> bool:
        """Whether a call of these tensors, lying back to back in memory (a DDP bucket's
        gradients), may go as one tensor named after the first with the same result: where
        `joins_runs`, or where ``strategy="auto"`` sends them all whole in one form (fp16 or
        dense, joined as `_whole_rounds` joins them) and the memory keeps nothing for them
        (`Memory.keeps_nothing_for`), on the flat exchange (on two levels each tensor has
        its owner).

        Args:
            names: The tensors' names, in order.

        Returns:
            True if the call may go as one tensor.
        """
        if self.joins_runs:
            return True
        if self.strategy is None or self.node_layout() is not None:
            return False
        forms = set(self.strategy.forms_of(names))
        return (len(forms) == 1 and COMPRESSED not in forms
                and self.memory.keeps_nothing_for(names))

    def _finite(self, grads: Named, compensated: Named, runs: Sequence[range]) -> bool:
        """Whether every tensor to compress is finite (one read each, one call for each of
        the `runs` of tensors back to back in memory, `gracecomm.wire.contiguous_runs`); with
        `check_finite`, raise `NonFiniteError` naming the first that is not, and whether the
        gradient or the error feedback added to it was non-finite."""
        tensors = [t for _, t in compensated]
        flats = [flat_run(tensors[run.start:run.stop]) for run in runs]
        for j in nonfinite_among(flats):
            for i in runs[j]:
                if not self._finite_one(grads[i], compensated[i]):
                    return False
        return True

    def _finite_one(self, grad: tuple[str, torch.Tensor], compensated: tuple[str, torch.Tensor]
                    ) -> bool:
        """`_finite` for one tensor."""
        name, tensor = compensated
        if is_finite(tensor, name):
            return True
        if not self.check_finite:
            return False
        is_finite(grad[1], name, raise_error=True)
        raise NonFiniteError(
            f"tensor '{name}': adding {self.memory.label}'s error feedback to its finite "
            "gradient overflowed (values beyond the dtype's range); scale the loss or the "
            "gradients down")

    def end_step(self) -> None:
        """Close the step that `start_many` calls opened.

        Where an exchange of the step carried a non-finite gradient on any rank (without
        ``check_finite``), the compression state from before the step is restored (class
        docstring)."""
        if self._nonfinite_step:
            self.load_state_dict(self._before_step)
            self.metrics.add("nonfinite_steps", 1)
        self._before_step, self._nonfinite_step = None, False
        self._in_step = False
        if self.strategy is not None:
            self.strategy.end_step()

    def _rounds(self, compensated: Named, link: Link) -> Rounds:
        """Compression (with any rounds of its own), memory update and the communicator's
        exchange of one call, as one generator of rounds (`gracecomm.exchange`)."""
        if not compensated:
            return []
        metrics = self.metrics
        compressed = yield from self._timed(
            self.compressor.compress_rounds(compensated, link), "compress_s")
        with metrics.timer("memory_s"):
            for (name, tensor), (payload, ctx) in zip(compensated, compressed):
                self._update_memory(tensor, name, payload, ctx)
        means = yield from self.communicator.exchange(
            [(payload, ctx, name) for (name, _), (payload, ctx) in zip(compensated, compressed)],
            link)
        if link.any_nonfinite:
            return self._nonfinite(compensated)
        if self.memory.wants_mean:
            with metrics.timer("memory_s"):
                self.memory.update_mean_many(compensated, self.compressor,
                                             [ctx for _, ctx in compressed], means)
        return means

    def _whole_rounds(self, compensated: Named, link: Link, form: str) -> Rounds:
        """``strategy="auto"``'s fp16 and dense forms: the tensors sent whole by the form's
        codec on its own allreduce, joined into one tensor where they are several of one
        dtype (`gracecomm.wire.joined`: one cast and one allreduce for a bucket, as
        `_run_rounds` does; the codecs send one element per element, so each tensor's mean
        is its share of the joint one); nothing of them is left to feed back
        (`Memory.update_sent_whole`)."""
        if not compensated:
            return []
        codec, communicator = self._codecs[form]
        joint = joined_tensor(compensated)
        items = [joint] if joint else compensated
        compressed = yield from self._timed(codec.compress_rounds(items, link), "compress_s")
        with self.metrics.timer("memory_s"):
            self.memory.update_sent_whole(compensated, self._codecs[DENSE][0])
        means = yield from communicator.exchange(
            [(payload, ctx, name) for (name, _), (payload, ctx) in zip(items, compressed)], link)
        if link.any_nonfinite:
            return self._nonfinite(compensated)
        return split_like(means[0], [t for _, t in compensated]) if joint else means

    def _nonfinite(self, compensated: Named) -> list[torch.Tensor]:
        """An exchange that carried a non-finite gradient on some rank (without
        `check_finite`): the step's state is restored at `end_step`, and its means are NaN."""
        self._nonfinite_step = True
        return [torch.full_like(t, math.nan) for _, t in compensated]

    def _run_rounds(self, compensated: Named, runs: Sequence[range], link: Link) -> Rounds:
        """`_rounds` for an elementwise compressor with a memory that keeps nothing
        (`Capabilities.elementwise`): each run of tensors that lie back to back in memory
        (a DDP bucket's gradients) is compressed and exchanged as one tensor, named after its
        first, and its mean split back into the tensors' shapes."""
        tensors = [t for _, t in compensated]
        if len(runs) == len(tensors):  # nothing to join
            return (yield from self._rounds(compensated, link))
        joint = [(compensated[run.start][0], flat_run(tensors[run.start:run.stop]))
                 for run in runs]
        means = yield from self._rounds(joint, link)
        return [part for run, mean in zip(runs, means)
                for part in split_like(mean, tensors[run.start:run.stop])]

    def _update_memory(self, tensor: torch.Tensor, name: str, payload: Payload,
                       ctx: Any) -> None:
        """`Memory.update` with this rank's own payload; a malformed one names the rank."""
        try:
            self.memory.update(tensor, name, self.compressor, payload, ctx)
        except PayloadError as err:
            raise PayloadError(f"{self.compressor.label} on rank {self.communicator.rank} "
                               f"produced a malformed payload for tensor '{name}': {err}"
                               ) from err

    def _model_rounds(self, compensated: Named, link: Link) -> Rounds:
        """`_rounds` for model-level compressors (`Compressor.compress_model`): compress
        every tensor in one call, update the memory with each tensor's selection, and
        exchange one joint payload whose mean is the concatenation of every tensor's mean
        (flattened, in order)."""
        if not compensated:
            return []
        metrics = self.metrics
        selections, payload, ctx = self._timed_compress(self.compressor.compress_model,
                                                        compensated)
        with metrics.timer("memory_s"):
            for (name, tensor), (sel_payload, sel_ctx) in zip(compensated, selections):
                self._update_memory(tensor, name, sel_payload, sel_ctx)
        means = yield from self.communicator.exchange([(payload, ctx, MODEL_ITEM)], link)
        if link.any_nonfinite:
            return self._nonfinite(compensated)
        return split_like(means[0], [t for _, t in compensated])

    def _timed(self, rounds: Generator[Works, None, Any], key: str
               ) -> Generator[Works, None, Any]:
        """`rounds`, with the time spent advancing it (not waiting for its collectives)
        added to `key`."""
        while True:
            with self.metrics.timer(key):
                try:
                    works = next(rounds)
                except StopIteration as stop:
                    result = stop.value
                    break
            yield works
        return result

    def _timed_compress(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a compression function, adding its time to ``compress_s`` except the time
        of its own collectives (PowerSGD's first round, LGC's index broadcast), which the
        communicator's primitives add to ``comm_s`` on this thread."""
        comm_before = self.metrics.added_here("comm_s")
        with self.metrics.timer("compress_s"):
            result = fn(*args)
        self.metrics.add("compress_s", comm_before - self.metrics.added_here("comm_s"))
        return result

    def set_epoch(self, epoch: int) -> None:
        """Tell schedules that change with the epoch (DGC's warm-up of the ratio) which one
        begins.

        Args:
            epoch: The epoch about to start, from 0.
        """
        self.compressor.set_epoch(epoch)



def layout_text(layout: Mapping[str, Any]) -> str:
    """A recorded node layout (`Grace.layout_state`) in words, for messages."""
    if layout.get("nodes") is None:
        return f"hierarchy {layout.get('hierarchy')!r}"
    return (f"hierarchy {layout.get('hierarchy')!r} on {layout['nodes']} node(s) x "
            f"{layout.get('ranks_per_node')} rank(s)")


def snapshot(state: Any) -> Any:
    """A copy of a nested state dict whose containers are new and whose tensors are the
    parts' own: valid as long as the parts replace their state tensors instead of writing
    into them, which every part does (tests/test_nonfinite.py and tests/test_core.py
    check it)."""
    if isinstance(state, Mapping):
        return {key: snapshot(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(value) for value in state)
    return state


Spec = str | Mapping[str, Any] | Compressor | Memory | Communicator | None


def make_part(spec: Spec, registry: Registry, base: type) -> Any:
    """One part from any of the forms `build` takes; wrappers such as DeepReduce use it for
    their nested parts.

    Args:
        spec: A registry name, a mapping with ``name`` (and options) or ``_target_``, or an
            instance of `base` (returned as is).
        registry: Where names are looked up (`COMPRESSORS`, ...).
        base: The class the part must be an instance of.

    Returns:
        The part.

    Raises:
        ConfigError: An unknown name or option, a mapping without ``name`` or ``_target_``,
            or a value of another type.
    """
    if isinstance(spec, base):
        return spec
    if isinstance(spec, str):
        return registry.create(spec)
    if isinstance(spec, Mapping):
        if "_target_" in spec:
            return instantiate(spec)
        params = dict(spec)
        if "name" not in params:
            raise ConfigError(f"a {registry.kind} given as a mapping needs 'name' or "
                              f"'_target_'; got keys {sorted(params)}")
        return registry.create(params.pop("name"), **params)
    raise ConfigError(f"{registry.kind} must be a name, a mapping or a {base.__name__}, "
                      f"got {type(spec).__name__}")


def build(compressor: Spec = "none", memory: Spec = None, communicator: Spec = None,
          *, check_finite: bool = True, hierarchy: str = FLAT,
          strategy: str | Strategy = FIXED) -> Grace:
    """Assemble a pipeline from names, mappings, Hydra configs or instances.

    This is the one place where a compressor's default memory and communicator are applied
    (the trainer's ``memory=auto`` and ``communicator=auto`` too). A memory or communicator
    left out (or ``"auto"``) is the compressor's default, which may depend on its options
    (Top-k brings residual memory and allgather; summable methods bring allreduce).

    Args:
        compressor: A registry name (``"topk"``; `available` lists them), a mapping with
            ``name`` and options (``{"name": "topk", "ratio": 0.01}``), a config with
            ``_target_``, or a `Compressor` instance.
        memory: The same forms for the memory; None or ``"auto"``: the compressor's
            default.
        communicator: The same forms for the communicator; None or ``"auto"``: the
            compressor's default.
        check_finite: Raise `NonFiniteError` on a non-finite gradient (True), or let a
            step with one pass through for a loss scaler to skip (False; see `Grace`).
        hierarchy: ``"flat"`` (the default) or ``"node"``: reduce dense inside each node
            and compress only what crosses nodes (`gracecomm.hierarchy`; with an initialised
            process group the node layout is gathered here, collectively).
        strategy: ``"fixed"`` (the default: every tensor compressed) or ``"auto"``: each
            tensor sent compressed, in fp16 or dense, as the cost model chooses from the
            run's own measurements (`gracecomm.strategy`); or a
            `gracecomm.strategy.Strategy` with options.

    Returns:
        The assembled `Grace` pipeline, its compressor's kernels already loaded.

    Raises:
        ConfigError: An unknown name (the message lists the valid ones), an unknown or
            invalid option (the message names it and what is allowed), or a ``_target_``
            that is not a registered part (old ``grace.*`` paths name the new one).
        IncompatibleError: The parts cannot work together (allreduce with Top-k).
        MissingDependencyError: The chosen option needs a package that is not installed.

    Example:
        >>> import gracecomm
        >>> gracecomm.build({"name": "topk", "ratio": 0.01})
        Grace(compressor='topk', memory='residual', communicator='allgather')
        >>> gracecomm.build("fp16", communicator="allgather")
        Grace(compressor='fp16', memory='none', communicator='allgather')
    """
    comp = make_part(compressor, COMPRESSORS, Compressor)
    caps = comp.capabilities()
    mem = make_part(default_part(memory, caps.default_memory), MEMORIES, Memory)
    comm = make_part(default_part(communicator, caps.default_communicator), COMMUNICATORS,
                     Communicator)
    return Grace(comp, mem, comm, check_finite=check_finite, hierarchy=hierarchy,
                 strategy=strategy)


AUTO = "auto"  # a memory or communicator chosen by the compressor


def default_part(spec: Spec, default: str) -> Spec:
    """`spec`, or the compressor's `default` name where `spec` is None or ``"auto"``."""
    return default if spec is None or (isinstance(spec, str) and spec == AUTO) else spec
