"""Declared state (gracecomm.state): nesting, binding and epochs recurse through the parts, and
the state layout is the one checkpoints of format 2 hold."""

from __future__ import annotations

import pytest
import torch

import gracecomm
from gracecomm.metrics import Metrics
from gracecomm.rng import SharedStreams
from gracecomm.state import Stateful


class Leaf(Stateful):
    state_attrs = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}


class Node(Stateful):
    state_attrs = ("step",)
    child_attrs = ("left", "many", "missing")

    def __init__(self) -> None:
        self.step = 0
        self.left = Leaf()
        self.many = [Leaf(), Leaf()]
        self.missing = None


class Deeper(Node):
    state_attrs = ("extra",)

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.zeros(2)


def test_state_nests_and_round_trips() -> None:
    node = Deeper()
    node.step, node.extra = 3, torch.ones(2)
    node.left.counts["a"] = 1
    node.many[1].counts["b"] = 2
    state = node.state_dict()
    assert state["step"] == 3 and torch.equal(state["extra"], torch.ones(2))
    assert state["left"] == {"counts": {"a": 1}}
    assert state["many"] == [{"counts": {}}, {"counts": {"b": 2}}]
    assert "missing" not in state  # None writes nothing
    node.left.counts["a"] = 5  # the state's containers are copies
    assert state["left"]["counts"]["a"] == 1

    other = Deeper()
    other.load_state_dict(state)
    assert other.step == 3 and other.left.counts == {"a": 1} and other.many[1].counts == {"b": 2}
    assert other.left.counts is not state["left"]["counts"]


def test_declarations_accumulate_over_subclasses() -> None:
    assert Deeper._declared("state_attrs") == ("step", "extra")
    assert Deeper._declared("child_attrs") == ("left", "many", "missing")


def test_a_stateless_child_loads_from_a_layout_without_it() -> None:
    class Holder(Stateful):
        child_attrs = ("part",)

        def __init__(self) -> None:
            self.part = Stateful()

    assert Holder().state_dict() == {"part": {}}
    Holder().load_state_dict({})  # written before the child was declared


def test_a_missing_entry_or_a_wrong_length_is_named() -> None:
    with pytest.raises(ValueError, match="no entry 'step'"):
        Node().load_state_dict({})
    state = Node().state_dict()
    state["many"] = state["many"][:1]
    with pytest.raises(ValueError, match="1 entries for 'many', this part has 2"):
        Node().load_state_dict(state)


class FakeComm:
    world_size, rank = 2, 1


def test_binding_and_epochs_reach_every_inner_compressor() -> None:
    """Compose's stages, DeepReduce's sparsifier and the QSGD compressor inside its value
    codec (a compressor below a non-compressor part) are bound with the owner."""
    comm, metrics = FakeComm(), Metrics()
    dr = gracecomm.COMPRESSORS.create("deepreduce", sparsifier={"name": "dgc", "warmup_epochs": 2},
                                  value="qsgd")
    dr.bind(comm, metrics)
    assert dr.sparsifier.comm is comm and dr.value.compressor.comm is comm
    assert dr.value.compressor.metrics is metrics
    before = dr.sparsifier.ratio
    dr.set_epoch(2)  # the warm-up is over: the sparsifier's own ratio
    assert dr.sparsifier.ratio != before and dr.sparsifier.ratio == 0.01

    compose = gracecomm.COMPRESSORS.create("compose", compressors=["topk", "natural"])
    compose.bind(comm, metrics)
    assert all(stage.comm is comm for stage in compose.stages)


def test_layout_of_checkpoint_format_2() -> None:
    """The states the hand-written methods wrote before `gracecomm.state`, literally: a
    checkpoint of format 2 loads into the declared parts."""
    streams = {"seed": 7, "counters": {"w": 3}}
    topk_qsgd = gracecomm.COMPRESSORS.create("deepreduce", value="qsgd")
    topk_qsgd.load_state_dict({"streams": streams, "sparsifier": {},
                               "value": {"streams": {"seed": 1, "counters": {"w": 2}}}})
    assert topk_qsgd.streams.counters == {"w": 3}
    assert topk_qsgd.value.compressor.streams.counters == {"w": 2}
    assert topk_qsgd.state_dict()["value"] == {"streams": {"seed": 1, "counters": {"w": 2}}}

    dgc = gracecomm.COMPRESSORS.create("dgc")
    dgc.load_state_dict({"ratio": 0.01, "calls": {"w": 4}, "streams": streams})
    assert dgc.calls == {"w": 4} and isinstance(dgc.streams, SharedStreams)
    assert dgc.state_dict() == {"ratio": 0.01, "calls": {"w": 4}, "streams": streams}

    pipeline = gracecomm.build({"name": "randomk", "ratio": 0.1})
    residual = {"w": torch.ones(3)}
    pipeline.load_state_dict({"compressor": {"streams": streams},
                              "memory": {"residuals": residual}, "communicator": {}})
    state = pipeline.state_dict()
    assert state["compressor"] == {"streams": streams} and state["communicator"] == {}
    assert torch.equal(state["memory"]["residuals"]["w"], residual["w"])
