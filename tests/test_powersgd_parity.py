"""PowerSGD at parity with PyTorch's ``powerSGD_hook``: with the hook's settings (dense
warm-up, min_compression_rate, error feedback against the mean, warm start, batching), the
same seed and data, two ranks train to the same bits over 100 steps on one bucket."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import gracecomm
from tests.helpers import agreed_on_every_rank, run_ranks

STEPS = 100
SETTINGS = [  # (rank, start_iter, min_compression_rate, error feedback, warm start, batching)
    (2, 2, 2.0, True, True, False),
    (2, 10, 1.0, True, True, True),
    (2, 2, 2.0, False, True, False),
    (2, 2, 2.0, True, False, False),
]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def train(rank: int, setting: tuple, ours: bool) -> torch.Tensor:
    r, start, min_rate, feedback, warm, batch = setting
    net = model()
    ddp = DistributedDataParallel(net)  # one bucket
    if ours:
        pipe = gracecomm.build({"name": "powersgd", "rank": r, "start_iter": start,
                            "min_compression_rate": min_rate, "warm_start": warm, "seed": 0,
                            "batch_same_shape": batch},
                           {"name": "residual", "reference": "mean"} if feedback else "none")
        gracecomm.register_comm_hook(ddp, pipe)
    else:
        state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=r, start_powerSGD_iter=start,
            min_compression_rate=min_rate, use_error_feedback=feedback, warm_start=warm,
            random_seed=0, batch_tensors_with_same_shape=batch)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 5, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return nn.utils.parameters_to_vector(net.parameters()).detach()


def check_parity(rank: int, world_size: int) -> None:
    for setting in SETTINGS:
        ours, theirs = train(rank, setting, True), train(rank, setting, False)
        assert torch.equal(ours, theirs), (setting, float((ours - theirs).abs().max()))
        agreed_on_every_rank(ours, setting)


@pytest.mark.slow
def test_powersgd_matches_pytorchs_hook_bit_for_bit():
    run_ranks(check_parity, 2, timeout_s=600)
