"""`Compressor.warm_up` prepares every registered compressor's kernels without touching the
compressor: same state, no metrics, no effect on the next call."""

from __future__ import annotations

import pytest
import torch

from gracecomm import registry
from tests.test_properties import make

NAMES = registry.available("compressor")


@pytest.mark.parametrize("name", NAMES)
def test_warm_up_changes_nothing(name):
    comp, twin = make(name), make(name)
    state = repr(comp.state_dict())
    comp.warm_up()
    assert repr(comp.state_dict()) == state
    assert comp.metrics.pop() == {}
    t = torch.randn(3, 700, generator=torch.Generator().manual_seed(0))
    if comp.capabilities().model_level:
        return
    (a, ctx_a), (b, ctx_b) = comp.compress(t, "w"), twin.compress(t, "w")
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # the same first call as without it
    assert torch.equal(comp.decompress(a, ctx_a), twin.decompress(b, ctx_b))


class ThreeRanks:
    world_size = 3


@pytest.mark.parametrize("name", ["natural", "qsgd", "onebit"])
def test_warm_up_aggregates_one_payload_per_rank(name, monkeypatch):
    """The receive kernels are compiled for the communicator's number of ranks."""
    comp = make(name)
    seen = []
    cls = type(comp)
    original = cls.aggregate
    monkeypatch.setattr(cls, "aggregate", lambda self, payloads, ctx: seen.append(
        len(payloads)) or original(self, payloads, ctx))
    comp.comm = ThreeRanks()
    comp.warm_up()
    assert seen == [3]
