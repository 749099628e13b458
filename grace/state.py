"""State that recurses, as in `torch.nn.Module`: a class declares which of its attributes
are checkpointed and which hold sub-parts, and `state_dict` / `load_state_dict` walk them.

- ``state_attrs`` name attributes whose values are the state itself: tensors, plain Python
  values, or dicts and lists of them (per-tensor residuals, counters).
- ``child_attrs`` name attributes holding parts that are themselves `Stateful` (a part, a
  list of parts, or None): their states nest under the attribute's name. None writes no
  entry, and a missing entry loads as an empty state, so a checkpoint written before a
  stateless sub-part was declared still loads.

Both tuples accumulate over the class hierarchy (a subclass lists only what it adds), and a
class with real custom logic (an RNG whose state is not a plain value, a lazily created
child) overrides the two methods and calls ``super()``.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, TypeVar

from gracecomm.validation import ConfigError

T = TypeVar("T")


class Stateful:
    """A part whose checkpoint state is declared, not hand-written."""

    state_attrs: ClassVar[tuple[str, ...]] = ()
    child_attrs: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @functools.cache
    def _declared(cls, kind: str) -> tuple[str, ...]:
        """The names the class and its bases list in `kind` (``state_attrs`` or
        ``child_attrs``), bases first: fixed per class, so computed once (`state_dict` runs
        every step of a run with ``check_finite=False``)."""
        names: dict[str, None] = {}
        for klass in reversed(cls.__mro__):
            names.update(dict.fromkeys(vars(klass).get(kind, ())))
        return tuple(names)

    def children(self) -> Iterator[Stateful]:
        """Every sub-part, in declaration order (lists of parts flattened).

        Returns:
            An iterator over the parts ``child_attrs`` hold.
        """
        for attr in self._declared("child_attrs"):
            value = getattr(self, attr)
            yield from (v for v in (value if isinstance(value, (list, tuple)) else (value,))
                        if v is not None)

    def nearest(self, kind: type[T]) -> Iterator[T]:
        """The closest sub-parts of a type: children of that type, and those found below
        children of other types (a compressor inside a codec), not below them.

        Args:
            kind: The type.

        Returns:
            An iterator over those sub-parts.
        """
        for child in self.children():
            if isinstance(child, kind):
                yield child
            else:
                yield from child.nearest(kind)

    def state_dict(self) -> dict[str, Any]:
        """The state needed to resume bit-identically.

        Returns:
            A nested dict of tensors and plain Python values only (loadable with
            ``torch.load(..., weights_only=True)``); containers are copied, tensors are the
            part's own (parts replace their state tensors instead of writing into them).

        Example:
            >>> import torch, gracecomm
            >>> grace = gracecomm.build({"name": "topk", "ratio": 0.5})
            >>> _ = grace.step(torch.tensor([1.0, -3.0]), "w")
            >>> grace.state_dict()["memory"]["residuals"]
            {'w': tensor([1., 0.])}
        """
        state = {attr: _copy(getattr(self, attr)) for attr in self._declared("state_attrs")}
        for attr in self._declared("child_attrs"):
            value = getattr(self, attr)
            if isinstance(value, (list, tuple)):
                state[attr] = [child.state_dict() for child in value]
            elif value is not None:
                state[attr] = value.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned.

        Args:
            state: A state dict of a part built with the same options.

        Raises:
            ValueError: An entry is missing, or a list of sub-parts has another length
                (the message names the entry).
        """
        for attr in self._declared("state_attrs"):
            if attr not in state:
                raise ValueError(f"{type(self).__name__}: the state has no entry '{attr}' "
                               f"(entries: {', '.join(map(str, state)) or 'none'})")
            setattr(self, attr, _copy(state[attr]))
        for attr in self._declared("child_attrs"):
            value = getattr(self, attr)
            if isinstance(value, (list, tuple)):
                if len(state[attr]) != len(value):
                    raise ValueError(f"{type(self).__name__}: the state has {len(state[attr])} "
                                     f"entries for '{attr}', this part has {len(value)}")
                for child, sub in zip(value, state[attr]):
                    child.load_state_dict(sub)
            elif value is not None:
                value.load_state_dict(state.get(attr, {}))


def _copy(value: Any) -> Any:
    """A new container around the same values (dicts and lists), or the value itself."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    return value


# torch's own lines around the reason a file was refused (they ask the user to file an issue)
_TORCH_PREAMBLE = ("Weights only load failed", "Please file an issue", "Check the documentation",
                   "In PyTorch 2.6", "Re-running")


def load_state(source: str | os.PathLike[str] | io.BytesIO, what: str) -> Any:
    """Read a saved state (``torch.load(..., weights_only=True)``): only tensors and plain
    Python values, so that a file cannot run code.

    Args:
        source: The file, or its bytes.
        what: How messages name it (``checkpoint runs/x/rank0-step4.pt``).

    Returns:
        What the file holds.

    Raises:
        ConfigError: Naming `what` and why: a pickled object that is not a tensor or a plain
            value (refused), or bytes that are not a torch file (truncated, another format).
    """
    import torch
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on the pickle protocol
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = " ".join(line.strip() for line in str(err).splitlines()
                          if line.strip() and not line.startswith(_TORCH_PREAMBLE))
        reason = reason.replace("WeightsUnpickler error: ", "").strip() or "unreadable"
        raise ConfigError(f"{what} is refused: it holds something other than tensors and plain "
                          f"Python values ({reason}); a state file may hold only those, so "
                          "that reading it cannot run code") from None
    except (RuntimeError, EOFError, OSError, ValueError, TypeError, KeyError) as err:
        first = (str(err).splitlines() or [""])[0][:200] or type(err).__name__
        raise ConfigError(f"{what} is not a readable torch file ({first}); it must be a "
                          "file that torch.save wrote, whole") from None
