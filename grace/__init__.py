"""gracecomm: compressed gradient communication for data-parallel PyTorch training.

Three abstractions, composed per tensor (the documentation's design page, docs/design.md,
describes how they fit together):

- `Compressor` turns a tensor into a payload (what goes on the wire) and a local ctx;
- `Memory` adds error feedback around it;
- `Communicator` exchanges payloads and returns the mean over ranks, counting the bytes.

Example:
    ```python
    from gracecomm import build, register_comm_hook
    grace = build({"name": "topk", "ratio": 0.01}, "residual")
    register_comm_hook(ddp_model, grace, optimizer)   # asynchronous, overlaps backward
    state, hook = comm_hook(grace, model, optimizer)  # for frameworks that register hooks
    # custom loops: GradientExchange(grace, model, optimizer).step() after backward,
    # or grace.step(tensor, name) per tensor
    ```
"""

from gracecomm.communicator import Communicator
from gracecomm.compressor import Compressor, Payload, TensorInfo
from gracecomm.ddp import GradientExchange, comm_hook, register_comm_hook
from gracecomm.memory import Memory
from gracecomm.metrics import Metrics
from gracecomm.needs import Need
from gracecomm.pipeline import Grace, build
from gracecomm.registry import COMMUNICATORS, COMPRESSORS, MEMORIES, available, create
from gracecomm.strategy import Strategy
from gracecomm.validation import ConfigError, IncompatibleError, NonFiniteError, PayloadError

__all__ = [
    "COMMUNICATORS", "COMPRESSORS", "MEMORIES", "Communicator", "Compressor", "ConfigError",
    "Grace", "GradientExchange", "IncompatibleError", "Memory", "Metrics", "Need",
    "NonFiniteError", "Payload", "PayloadError", "Strategy", "TensorInfo", "available", "build",
    "comm_hook", "create", "register_comm_hook",
]
__version__ = "0.1.0"
