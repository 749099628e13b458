"""What every part of a pipeline shares: `Compressor`, `Memory` and `Communicator` derive
from `Part`, which defines once their name in messages (`label`), their checkpoint state
(`gracecomm.state.Stateful`) and how the pipeline binds them (`bind`: its shared `Metrics`
and its communicator's accounted collectives).

A role base declares its role with a class keyword, ``class Memory(Part, kind="memory")``:
the word labels use, and the type whose sub-parts share a part's binding.
"""

from __future__ import annotations

from typing import Any, ClassVar

from gracecomm.exchange import Collectives
from gracecomm.metrics import Metrics
from gracecomm.state import Stateful


class Part(Stateful):
    """Base of the three roles of a pipeline (compressor, memory, communicator).

    Attributes:
        registry_name: The name the class is registered under (set by the registry).
        kind: The role's word in messages (``"compressor"``); declared by a role base.
        role: The role base itself (`Compressor`, `Memory`, `Communicator`).
        metrics: The `Metrics` this part records into: its own until the pipeline binds it.
        comm: The accounted collectives it may use (the pipeline's communicator), or None
            outside a pipeline or before `bind`.
    """

    registry_name: ClassVar[str] = ""
    kind: ClassVar[str] = "part"
    role: ClassVar[type[Part]]

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            cls.kind, cls.role = kind, cls

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.comm: Collectives | None = None

    @property
    def label(self) -> str:
        """How messages name this part: its role and registry name (``compressor 'topk'``)."""
        return f"{self.kind} '{self.registry_name or type(self).__name__}'"

    def bind(self, comm: Collectives | None, metrics: Metrics) -> None:
        """Called by the pipeline once it is assembled (`gracecomm.Grace`).

        The part records into the pipeline's `metrics` and reaches the other ranks through
        `comm`; the nearest sub-parts of its own role (``child_attrs``, `gracecomm.state`:
        the stages of a `Compose`, the compressor inside a DeepReduce codec) are bound
        alike. Sub-parts of another role keep their own (a parameter server's downlink
        compressor keeps its statistics apart from the uplink's).

        Args:
            comm: The pipeline's communicator (its accounted collectives: `all_reduce`,
                `broadcast`, ...), or None for a part used on its own in one process.
            metrics: The pipeline's shared statistics.
        """
        self.comm = comm
        self.metrics = metrics
        for part in self.nearest(self.role):
            part.bind(comm, metrics)
