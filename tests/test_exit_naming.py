"""Every exit is named (issue 34): a rank that exits with code 0 before its work is done is
reported as such, not its peer's lost connection; a tensor of finite values that overflow
is never said to hold NaN or Inf."""

from __future__ import annotations

import os

import pytest
import torch

import gracecomm
from gracecomm.experiments.training.launch import WorkerError, spawn


def exits_early(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    dist.barrier()
    if rank == 1:
        os._exit(0)
    dist.all_reduce(torch.ones(4))  # rank 0 waits here for a peer that is gone


def finishes(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    dist.all_reduce(torch.ones(4))


@pytest.mark.slow
def test_a_rank_that_exits_with_code_0_early_is_named():
    with pytest.raises(WorkerError) as info:
        spawn(exits_early, 2, timeout_s=60, collective_timeout_s=30)
    first = str(info.value).split("\n")[0]
    assert first.startswith("worker rank 1 of 2 exited with code 0 before its work was done"), \
        first


@pytest.mark.slow
def test_ranks_that_finish_are_not_named():
    spawn(finishes, 2, timeout_s=60, collective_timeout_s=30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_values_that_overflow_are_not_blamed_on_nan(dtype):
    big = torch.finfo(dtype).max / 3
    x = torch.full((1000,), big, dtype=dtype)
    x[::2] = -big
    with pytest.raises(gracecomm.NonFiniteError) as info:
        gracecomm.build("gaussiank").compressor.compress(x, "w")
    message = str(info.value)
    assert "holds no NaN or Inf" in message and "overflow" in message, message
    assert "0 NaN" not in message
