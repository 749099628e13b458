"""The parameter-server communicator carries any compressor: the master averages every rank's
payloads, optionally re-compresses the mean for the downlink, and every rank ends with the
same bits; bytes are counted in both directions; a failure on the master reaches every rank."""

import pytest
import torch
import torch.distributed as dist

import gracecomm
from gracecomm.communicators.parameter_server import ParameterServer, ServerError, pack, unpack
from gracecomm.compressor import TensorInfo
from gracecomm.compressors.topk import TopK
from gracecomm.config import instantiate
from gracecomm.wire import payload_nbytes
from tests.helpers import compose_train, run_ranks
from tests.test_distributed import OPTIONS, expected_mean, rank_tensors


class CorruptTopK(TopK):
    """Top-k whose rank 1 sends indices beyond the tensor (a malformed peer payload)."""

    def compress(self, tensor, name):
        (values, indices), ctx = super().compress(tensor, name)
        if dist.get_rank() == 1:
            indices = indices + 1000
        return (values, indices), ctx


def same_on_every_rank(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(gathered[0], t) for t in gathered)


def check_parameter_server(rank, world_size):
    tensors = rank_tensors(rank)
    for master in (0, world_size - 1):
        for name in ("none", "fp16", "topk", "randomk", "threshold"):
            comm = ParameterServer(master_rank=master)
            g = gracecomm.build({"name": name, **OPTIONS.get(name, {})}, "none", comm)
            outs = g.step_many(list(tensors.items()))
            stats = g.metrics.pop()
            own = [g.compressor.compress(t, n)[0] for n, t in tensors.items()]
            for (tname, t), out in zip(tensors.items(), outs):
                want = expected_mean(name, world_size, tname)
                assert out.shape == t.shape
                tol = 2e-3 if name == "fp16" else 1e-6
                assert torch.allclose(out, want, atol=tol), (name, tname)
                assert same_on_every_rank(out), (name, tname)
            if name != "randomk":  # its shared-seed indices advanced once more above
                assert stats["wire_bytes"] == sum(payload_nbytes(p) for p in own), name
            assert stats["downlink_bytes"] == sum(4 * t.numel() for t in tensors.values())
            assert stats["coll_ps_push_calls"] == 1 and stats["coll_ps_pull_calls"] == 3
    # bidirectional compression: the downlink re-compresses the mean, every rank decodes it
    for downlink in ("fp16", {"name": "topk", "ratio": 0.25}):
        g = gracecomm.build("none", "none", {"name": "parameter_server", "downlink": downlink})
        outs = g.step_many(list(tensors.items()))
        stats = g.metrics.pop()
        down, sent = g.communicator.downlink, 0
        for tname, out in zip(tensors, outs):
            mean = expected_mean("none", world_size, tname)
            payload, ctx = down.compress(mean, tname)
            sent += payload_nbytes(payload)
            assert torch.allclose(out, down.decompress(payload, ctx), atol=1e-6), (downlink, tname)
            assert same_on_every_rank(out)
        assert stats["downlink_bytes"] == sent < sum(4 * t.numel() for t in tensors.values())
        assert stats["wire_bytes"] == sum(4 * t.numel() for t in tensors.values())
    # all ranks send nothing: no hang, zeros back
    g = gracecomm.build({"name": "threshold", "threshold": 10.0}, "none", "parameter_server")
    assert g.step(torch.zeros(5), "z").eq(0).all()
    assert g.metrics.pop()["wire_bytes"] == 0
    # a malformed payload fails on the master, and every other rank learns it instead of waiting
    g = gracecomm.build(CorruptTopK(0.2), "none", "parameter_server")
    expected = gracecomm.PayloadError if rank == 0 else ServerError
    with pytest.raises(expected, match="sparse indices span"):
        g.step(torch.randn(20), "w")
    # so does a downlink whose ctx the workers cannot rebuild
    g = gracecomm.build("none", "none", {"name": "parameter_server", "downlink": "randomk"})
    expected = gracecomm.IncompatibleError if rank == 0 else ServerError
    with pytest.raises(expected, match="ctx"):
        g.step(torch.randn(20), "w")
    # a master outside the world is refused on every rank before any collective
    with pytest.raises(gracecomm.ConfigError, match="'master_rank' is 7"):
        gracecomm.build("none", "none", ParameterServer(master_rank=7)).step(torch.ones(2), "x")
    # the pipeline still works after the failures above (no collective was left half done)
    assert same_on_every_rank(gracecomm.build("topk", "none", "parameter_server").step(
        torch.randn(30), "after"))


@pytest.mark.slow
def test_parameter_server_returns_the_mean():
    run_ranks(check_parameter_server, 3)  # the master first and last, a rank in between


def test_single_process_and_options():
    g = gracecomm.build({"name": "topk", "ratio": 0.5}, "none",
                    {"name": "parameter_server", "downlink": "fp16"})
    x = torch.tensor([1.0, -3.0, 0.5, 2.0])
    assert torch.equal(g.step(x, "x"), torch.tensor([0.0, -3.0, 0.0, 2.0]))
    stats = g.metrics.pop()
    assert (stats["wire_bytes"], stats["downlink_bytes"]) == (16, 8)
    assert g.communicator.state_dict() == {"downlink": {}}
    with pytest.raises(gracecomm.ConfigError, match="'downlink' must be"):
        ParameterServer(downlink=3)
    with pytest.raises(gracecomm.IncompatibleError, match="whole models"):
        ParameterServer(downlink="lgc_rar")
    with pytest.raises(gracecomm.ConfigError, match="'master_rank'"):
        ParameterServer(master_rank=-1)


def test_downlink_header_round_trips():
    payloads = [(TensorInfo(torch.Size([2, 3]), torch.float32),
                 (torch.randn(4), torch.arange(4, dtype=torch.int32), torch.tensor(2.5))),
                (TensorInfo(torch.Size([5]), torch.float16), (torch.ones(2, 2).half(),))]
    back = unpack(*pack(payloads))
    for (info, payload), (info2, payload2) in zip(payloads, back):
        assert info == info2
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(payload, payload2))


def test_downlink_from_the_command_line():
    cfg = compose_train("compressor=topk", "communicator=parameter_server",
                        "communicator.downlink=fp16")
    comm = instantiate(cfg.communicator)
    assert isinstance(comm, ParameterServer) and comm.downlink.registry_name == "fp16"
    cfg = compose_train("compressor=lgc_ps")
    assert cfg.communicator._target_.endswith("ParameterServer")
