"""Composition of compressors (Horvath et al., *Natural Compression*, Theorem 3: if C1 is in
B(w1) and C2 in B(w2), C1 o C2 is in B(w1 w2)).

``Compose([C1, C2, ...])`` compresses with C1, then re-encodes the *values* C1 keeps (the
first tensor of its payload) with C2, and so on: Top-k then natural compression sends
nat9-encoded values plus Top-k's indices; shared-seed Random-k then natural dithering sends
only the dithered values. The payload is what is actually sent: the last stage's payload
followed by the remaining tensors of the earlier stages (last to first).

A receiver decodes a peer's later stages with its own ctx, so the first stage must keep a
number of values that depends only on the tensor's shape (Top-k, Random-k); a peer whose
count differs is rejected as a malformed payload. Capabilities follow the stages: summable
(allreduce) only if every stage is, residual memory if any stage asks for it, and the
training defaults and sensitivities of every stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gracecomm.compressor import Capabilities, Compressor, Payload
from gracecomm.needs import Need
from gracecomm.pipeline import make_part
from gracecomm.registry import COMPRESSORS
from gracecomm.validation import ConfigError, PayloadError


@dataclass(frozen=True)
class ComposeCtx:
    ctxs: tuple[Any, ...]    # each stage's ctx
    counts: tuple[int, ...]  # tensors each stage leaves in the payload (the last: all of its own)


@COMPRESSORS.register("compose")
class Compose(Compressor):
    """Apply `compressors` in order, each to the values kept by the previous one. Stages are
    instances, registry names or mappings (``Compose([{"name": "topk", "ratio": 0.01},
    "natural"])``)."""

    child_attrs = ("stages",)

    def __init__(self, compressors: Sequence[Compressor | str | Mapping[str, Any]]) -> None:
        super().__init__()
        stages = [make_part(c, COMPRESSORS, Compressor) for c in compressors]
        if len(stages) < 2:
            raise ConfigError(f"{self.label}: option 'compressors' needs at least two "
                              f"compressors, got {len(stages)}")
        for i, stage in enumerate(stages):
            if not isinstance(stage, Compressor) or stage.capabilities().model_level:
                raise ConfigError(f"{self.label}: compressors[{i}] must be a per-tensor "
                                  f"compressor, got {type(stage).__name__}")
        self.stages = stages
        self.adopt_training_needs(stages)

    def capabilities(self) -> Capabilities:
        """Summable, of fixed size and elementwise when every stage is; residual memory when
        any stage brings it; the communicators every stage allows."""
        stages = [s.capabilities() for s in self.stages]
        summable = all(s.summable for s in stages)
        allowed = [set(s.communicators) for s in stages if s.communicators is not None]
        return Capabilities(
            summable=summable, fixed_size=all(s.fixed_size for s in stages),
            default_memory=("residual" if any(s.default_memory == "residual" for s in stages)
                            else "none"),
            default_communicator="allreduce" if summable else "allgather",
            communicators=tuple(sorted(set.intersection(*allowed))) if allowed else None,
            elementwise=all(s.elementwise for s in stages),
            model_level=False)  # no stage is (refused in __init__)

    def needs(self) -> frozenset[Need]:
        return frozenset().union(*(stage.needs() for stage in self.stages))

    @property
    def label(self) -> str:
        names = getattr(self, "stages", None)
        inner = "" if names is None else "(" + ", ".join(s.registry_name for s in names) + ")"
        return f"compressor 'compose{inner}'"

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        payload, ctx = self.stages[0].compress(tensor, name)
        ctxs, rests = [ctx], []
        for i, stage in enumerate(self.stages[1:], start=1):
            values = payload[0] if payload else None
            if values is None or not values.is_floating_point():
                raise TypeError(f"{self.label}: compressors[{i - 1}] sends no floating-point "
                                "values for the next stage to re-encode")
            rests.append(payload[1:])
            payload, ctx = stage.compress(values, f"{name}/{i}")
            ctxs.append(ctx)
        counts = tuple(len(r) for r in rests) + (len(payload),)
        flat = tuple(payload) + tuple(t for rest in reversed(rests) for t in rest)
        return flat, ComposeCtx(tuple(ctxs), counts)

    def first_stage_payload(self, payload: Payload, ctx: ComposeCtx) -> Payload:
        """Decode the later stages: the payload the first stage produced."""
        pos = ctx.counts[-1]
        values = self.stages[-1].decompress(tuple(payload[:pos]), ctx.ctxs[-1])
        for i in range(len(self.stages) - 2, -1, -1):
            rest = tuple(payload[pos:pos + ctx.counts[i]])
            pos += ctx.counts[i]
            if i == 0:
                if pos != len(payload):
                    raise PayloadError(f"{self.label} payload has {len(payload)} tensors, "
                                       f"expected {pos}")
                return (values.reshape(-1), *rest)
            values = self.stages[i].decompress((values.reshape(-1), *rest), ctx.ctxs[i])
        raise AssertionError("unreachable: Compose has at least two stages")

    def decompress(self, payload: Payload, ctx: ComposeCtx) -> torch.Tensor:
        return self.stages[0].decompress(self.first_stage_payload(payload, ctx), ctx.ctxs[0])

    def aggregate(self, payloads: Sequence[Payload], ctx: ComposeCtx) -> torch.Tensor:
        """The first stage aggregates (one scatter-add for sparsifiers, a vote for signs)."""
        return self.stages[0].aggregate([self.first_stage_payload(p, ctx) for p in payloads],
                                        ctx.ctxs[0])

