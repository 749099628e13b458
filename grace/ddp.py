"""DistributedDataParallel integration: a communication hook that runs the Grace pipeline.

    ddp = DistributedDataParallel(model)
    grace = build({"name": "topk", "ratio": 0.01}, "residual")
    register_comm_hook(ddp, grace)

For each gradient bucket the hook compresses every parameter's gradient separately (its own
k, its own statistics, its own residual keyed by the parameter name), exchanges the bucket's
payloads in one collective (plus one for the sizes where they vary) and writes the mean over
ranks back into the bucket. The hook runs synchronously and returns a completed future.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from grace.pipeline import Grace


@dataclass
class GraceHookState:
    """What the hook needs: the pipeline and the name of every parameter (by identity)."""

    grace: Grace
    names: dict[int, str]


def grace_hook(state: GraceHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress, exchange and average one bucket (see module docstring). The annotations are
    real objects, not strings: DDP inspects them when the hook is registered."""
    grads = bucket.gradients()
    names = [state.names[id(p)] for p in bucket.parameters()]
    averaged = state.grace.step_many(list(zip(names, grads)))
    buffer = bucket.buffer()
    for grad, mean in zip(grads, averaged):
        if grad.data_ptr() != mean.data_ptr():
            grad.copy_(mean.view_as(grad))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def register_comm_hook(model: DistributedDataParallel, grace: Grace) -> GraceHookState:
    """Make `model` exchange its gradients through `grace`; returns the hook's state."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"register_comm_hook needs a DistributedDataParallel model, got "
                        f"{type(model).__name__}; wrap it first or call grace.step() yourself")
    names = {id(p): n for n, p in model.module.named_parameters()}
    state = GraceHookState(grace, names)
    model.register_comm_hook(state, grace_hook)
    return state
