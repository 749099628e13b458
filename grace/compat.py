"""GRACE's parameter dictionary on this library's parts.

GRACE (Xu et al., *GRACE: A Compressed Communication Framework for Distributed Machine
Learning*, ICDCS 2021) builds its compressor, memory and communicator from one flat
dictionary in its ``grace_from_params`` helper: ``compressor``, ``memory``,
``communicator`` and the options of the chosen ones (``compress_ratio``, ``quantum_num``,
...). `grace_from_params` here accepts the same dictionary, maps GRACE's names onto this
library's registry names and returns a `Grace` pipeline whose ``step(tensor, name)`` plays
the part of GRACE's ``communicator.step``::

    from gracecomm.compat import grace_from_params
    grc = grace_from_params({"compressor": "topk", "memory": "residual",
                             "communicator": "allgather", "compress_ratio": 0.01,
                             "world_size": dist.get_world_size()})
    mean = grc.step(tensor, name)

An option GRACE reads with a default gets GRACE's default when it is left out (Top-k keeps
``compress_ratio`` 0.3 of the elements, as in GRACE), so a dictionary means the method it
meant there. As in GRACE, an option of a part that was not chosen is not used (one
dictionary can serve a sweep over compressors); a key GRACE does not know, or a GRACE
method without a counterpart here, raises `ConfigError` listing what is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from gracecomm.pipeline import Grace, build
from gracecomm.registry import did_you_mean
from gracecomm.validation import ConfigError


class Entry(NamedTuple):
    """A GRACE part: this library's registry name and its options, each GRACE key mapped
    to (our option, GRACE's default)."""

    name: str
    options: dict[str, tuple[str, Any]]


_RATIO = {"compress_ratio": ("ratio", 0.3)}
_QSGD = {"quantum_num": ("levels", 127), "bucket_size": ("bucket", 128)}

COMPRESSORS: dict[str, Entry] = {
    "dgc": Entry("dgc", _RATIO),
    "efsignsgd": Entry("efsignsgd", {}),  # GRACE's `lr` belongs to the efsignsgd memory here
    "fp16": Entry("fp16", {}),
    "natural": Entry("natural", {}),
    "natural_cuda": Entry("natural", {}),  # one implementation for CPU and CUDA tensors
    "none": Entry("none", {}),
    "onebit": Entry("onebit", {}),
    "powersgd": Entry("powersgd", {"compress_rank": ("rank", 1)}),
    "qsgd": Entry("qsgd", _QSGD),
    "qsgd_cuda": Entry("qsgd", _QSGD),
    "randomk": Entry("randomk", _RATIO),
    "signsgd": Entry("signsgd", {}),
    "signum": Entry("signum", {"momentum": ("momentum", 0.9)}),
    "terngrad": Entry("terngrad", {}),
    "threshold": Entry("threshold", {"threshold": ("threshold", 0.01)}),
    "topk": Entry("topk", _RATIO),
}
MEMORIES: dict[str, Entry] = {
    "none": Entry("none", {}),
    "residual": Entry("residual", {}),
    "dgc": Entry("dgc", {"momentum": ("momentum", 0.9)}),
    "efsignsgd": Entry("efsignsgd", {"lr": ("lr", 0.1)}),
    # GRACE's PowerSGD memory holds the residual and Q; here the compressor keeps Q
    "powersgd": Entry("residual", {}),
}
COMMUNICATORS = ("allreduce", "allgather", "broadcast")
# keys read outside the tables: the process group's size; Top-k's kernel (torch or GRACE's
# CUDA radix top-k: the same selection; torch.topk runs on any device here); DGC memory's
# gradient clipping switch
OTHER_KEYS = ("compressor", "memory", "communicator", "world_size", "kernel",
              "gradient_clipping")


def accepted_keys() -> list[str]:
    """Every key `grace_from_params` reads."""
    keys = dict.fromkeys(OTHER_KEYS)
    for table in (COMPRESSORS, MEMORIES):
        for entry in table.values():
            keys.update(dict.fromkeys(entry.options))
    return list(keys)


def _choose(params: Mapping[str, Any], key: str, default: str,
            allowed: Mapping[str, Any] | tuple[str, ...]) -> str:
    value = params.get(key, default)
    if value not in allowed:
        raise ConfigError(f"GRACE params: {key} {value!r} has no counterpart here; GRACE's "
                          f"{key}s accepted: {', '.join(allowed)} (or build this library's "
                          "own names with gracecomm.build)")
    return str(value)


def _spec(entry: Entry, params: Mapping[str, Any]) -> dict[str, Any]:
    """The registry spec ``{"name": ..., options}`` of `entry`, GRACE's defaults filled in."""
    return {"name": entry.name,
            **{ours: params.get(key, default) for key, (ours, default) in entry.options.items()}}


def grace_from_params(params: Mapping[str, Any], *, check_finite: bool = True) -> Grace:
    """The pipeline GRACE's ``grace_from_params(params)`` describes (see the module doc)."""
    accepted = accepted_keys()
    for key in params:
        if key not in accepted:
            raise ConfigError(f"GRACE params: unknown key {key!r}."
                              f"{did_you_mean(key, accepted)} GRACE's keys accepted: "
                              f"{', '.join(accepted)}")
    compressor = COMPRESSORS[_choose(params, "compressor", "none", tuple(COMPRESSORS))]
    memory = _choose(params, "memory", "none", tuple(MEMORIES))
    communicator = _choose(params, "communicator", "allreduce", COMMUNICATORS)
    if memory == "dgc" and params.get("gradient_clipping", False):
        raise ConfigError("GRACE params: gradient_clipping=True (GRACE clamps each value at "
                          "the ranks' root mean square) has no counterpart here; DGC's memory "
                          "clips by norm instead: gracecomm.build(..., memory={'name': 'dgc', "
                          "'clip_norm': ...})")
    grc = build(_spec(compressor, params), _spec(MEMORIES[memory], params), communicator,
                check_finite=check_finite)
    world_size = params.get("world_size")
    if world_size is not None and world_size != grc.communicator.world_size:
        raise ConfigError(f"GRACE params: world_size is {world_size} but the process group "
                          f"has {grc.communicator.world_size} ranks (initialise "
                          "torch.distributed before building)")
    return grc
