"""Where a method's tensors leave the device: a `TorchFunctionMode` that records, while it is
active, every torch call that brings data from the device to the host or mixes host tensors
into device work, and the line of the library that made it.

Kinds of events (each counted per line of code):

- ``scalar``: a device tensor read into a Python value (``item``, ``int()``, ``float()``,
  ``bool()``, ``tolist``, ``torch.equal``): the host waits for the device (a sync);
- ``shape``: an operation whose output size depends on the data (``nonzero``, a boolean
  mask as index, ``masked_select``, ``unique``, ``repeat_interleave`` without
  ``output_size``): the host waits for the count (a sync);
- ``numpy``: a device tensor handed to numpy (fails on CUDA);
- ``to_host``: a device tensor copied to the host (``cpu()``, ``to("cpu")``, ``copy_``),
  which waits for the device too; the elements copied are counted as well;
- ``to_device``: a host tensor of more than one element copied to the device (the host
  made data the device could have made);
- ``host_tensor``: a host tensor of more than one element used in an operation with device
  tensors (an error on CUDA, or an implicit copy for an index).

On a CUDA device "device tensor" means a CUDA tensor. Without one, ``emulate=True``
tracks which CPU tensors *would* be on the device: the tensors given to `adopt` (the
input), everything computed from them, and tensors created with a ``device=`` taken from a
tensor (a `torch.device`, not the string ``"cpu"``); ``to(device)`` with a `torch.device`
moves a tensor there, ``cpu()`` and ``to("cpu")`` take it back. That finds the host round
trips of the torch code paths on a machine without a GPU; on CUDA the counts are exact,
and `torch.cuda.set_sync_debug_mode` adds the syncs inside operations
(`gracecomm.experiments.checks.gpucheck` counts both).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

TAG = "_gracecomm_on_device"  # attribute marking the tensors an emulated device holds
SCALAR_READS = frozenset({"item", "tolist", "__int__", "__float__", "__bool__", "__index__",
                          "__complex__", "equal", "allclose", "is_nonzero"})
SHAPE_SYNCS = frozenset({"nonzero", "masked_select", "unique", "unique_consecutive",
                         "argwhere", "bincount"})
NUMPY = frozenset({"numpy", "__array__"})
TRANSFERS = frozenset({"to", "cpu", "cuda", "copy_"})
SYNC_KINDS = ("scalar", "shape", "to_host")  # the events that make the host wait


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def site() -> str:
    """``module:line`` of the innermost frame of the library (outside its experiments)."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("gracecomm.") and not module.startswith("gracecomm.experiments"):
            return f"{module}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class HostWatch(TorchFunctionMode):
    """Records host round trips of device tensors (module docstring) in `events`, keyed by
    (phase, kind, site); set `phase` to attribute them to a part of the work.

    Example::

        watch = HostWatch(torch.device("cpu"), emulate=True)
        with watch:
            x = watch.adopt(torch.randn(1000))
            int(x.abs().argmax())          # one 'scalar' event
        watch.count("scalar")              # 1
    """

    def __init__(self, device: torch.device, emulate: bool) -> None:
        super().__init__()
        self.device = device
        self.emulate = emulate
        self.phase = ""
        self.events: Counter[tuple[str, str, str]] = Counter()
        self.copied: Counter[tuple[str, str]] = Counter()  # (phase, kind) -> elements moved

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, now counted as held by the device (emulation; a no-op on CUDA)."""
        if self.emulate:
            setattr(tensor, TAG, True)
        return tensor

    def on_device(self, tensor: torch.Tensor) -> bool:
        if self.emulate:
            return bool(getattr(tensor, TAG, False))
        return tensor.device.type == self.device.type

    def count(self, kind: str, phase: str | None = None) -> int:
        return sum(n for (p, k, _), n in self.events.items()
                   if k == kind and (phase is None or p == phase))

    def sites(self, kinds: tuple[str, ...], phase: str | None = None) -> dict[str, int]:
        """Events of `kinds` by ``kind@site``."""
        out: Counter[str] = Counter()
        for (p, k, where), n in self.events.items():
            if k in kinds and (phase is None or p == phase):
                out[f"{k}@{where}"] += n
        return dict(out)

    def _record(self, kind: str, elements: int = 0) -> None:
        self.events[(self.phase, kind, site())] += 1
        if elements:
            self.copied[(self.phase, kind)] += elements

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = list(tensors_in((args, kwargs)))
        on = [self.on_device(t) for t in inputs]
        if any(on):
            self._classify(name, args, kwargs, inputs, on)
        out = func(*args, **kwargs)
        if name in TRANSFERS:
            return self._transfer(name, args, out)
        in_place = bool(args) and out is args[0]  # keeps its place, like `t.add_(x)`
        if self.emulate and not in_place and (any(on) or _device_kwarg(kwargs)):
            for t in tensors_in(out):
                setattr(t, TAG, True)
        return out

    def _classify(self, name: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor],
                  on: list[bool]) -> None:
        if name in SCALAR_READS:
            self._record("scalar")
        elif name in NUMPY:
            self._record("numpy")
        elif (name in SHAPE_SYNCS or (name == "where" and len(args) + len(kwargs) == 1)
              or (name == "repeat_interleave" and "output_size" not in kwargs)
              or (name in ("__getitem__", "__setitem__") and _bool_index(args, name))):
            self._record("shape")
        elif self.emulate and name not in TRANSFERS and any(
                not o and t.dim() > 0 and t.numel() > 1 for t, o in zip(inputs, on)):
            self._record("host_tensor")

    def _transfer(self, name: str, args: tuple, out: Any) -> Any:
        """Events and (emulation) placement of ``to``, ``cpu``, ``cuda`` and ``copy_``;
        returns `out`, in emulation a new view of the same data where the move returned
        its input itself (a CPU tensor moved to the CPU) and the places differ."""
        if name == "copy_":
            dst, src = args[0], args[1]
            if isinstance(src, torch.Tensor):
                if self.on_device(src) and not self.on_device(dst):
                    self._record("to_host", src.numel())
                elif not self.on_device(src) and self.on_device(dst) and src.numel() > 1:
                    self._record("to_device", src.numel())
            return out
        src = args[0]
        if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
            return out
        if self.emulate:
            target = _target_device(name, args[1:])
            held = self.on_device(src) if target is None else target
            if out is src and held != self.on_device(src):
                out = src.view(src.shape)
            if held:
                setattr(out, TAG, True)
        if self.on_device(src) and not self.on_device(out):
            self._record("to_host", src.numel())
        elif not self.on_device(src) and self.on_device(out) and src.numel() > 1:
            self._record("to_device", src.numel())
        return out


def _device_kwarg(kwargs: dict) -> bool:
    """Whether a factory was given a device taken from a tensor (emulation)."""
    device = kwargs.get("device")
    return isinstance(device, torch.device) or (isinstance(device, str) and device != "cpu")


def _target_device(name: str, rest: tuple) -> bool | None:
    """Whether ``to``/``cpu``/``cuda`` moves to the (emulated) device, to the host, or None
    when it names no device (a dtype change keeps the tensor where it is)."""
    if name == "cpu":
        return False
    if name == "cuda":
        return True
    for arg in rest:
        if isinstance(arg, torch.device):
            return True
        if isinstance(arg, str):
            return arg != "cpu"
        if isinstance(arg, torch.Tensor):  # to(other): other's place
            return bool(getattr(arg, TAG, False))
    return None


def _bool_index(args: tuple, name: str) -> bool:
    """Whether ``t[mask]`` (or ``t[mask] = v`` with a tensor v) indexes with a bool mask."""
    if len(args) < 2:
        return False
    index = args[1]
    parts = index if isinstance(index, tuple) else (index,)
    masked = any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    if name == "__setitem__":  # a scalar value is a masked fill, without a sync
        value = args[2] if len(args) > 2 else None
        return masked and isinstance(value, torch.Tensor) and value.numel() > 1
    return masked
