"""DEFLATE (RFC 1951) of byte tensors, for codecs that entropy-code a byte stream (e.g.
DeepReduce's DEFLATE index and value codecs). The stream is a raw deflate stream (no zlib
header or checksum) prefixed with the uncompressed length as a little-endian u32, so a
receiver can refuse a stream that does not expand to exactly the size it expects. Runs on
the CPU (zlib); the result is moved back to the input's device."""

from __future__ import annotations

import struct
import zlib

import torch

from gracecomm.validation import PayloadError

_LENGTH = struct.Struct("<I")


def byte_tensor(raw: bytes, device: torch.device | str = "cpu") -> torch.Tensor:
    """A uint8 tensor holding a copy of `raw` (which may be empty) on `device`."""
    if not raw:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def deflate(data: torch.Tensor, level: int = 6) -> torch.Tensor:
    """Compress the uint8 tensor `data` into ``u32 length + raw deflate stream``."""
    if data.dtype != torch.uint8:
        raise TypeError(f"deflate: expected a uint8 tensor, got {data.dtype}")
    raw = data.reshape(-1).cpu().numpy().tobytes()
    if len(raw) >= 2**32:
        raise ValueError(f"deflate: {len(raw)} bytes exceed the u32 length field")
    packer = zlib.compressobj(level, zlib.DEFLATED, -15)
    out = _LENGTH.pack(len(raw)) + packer.compress(raw) + packer.flush()
    return byte_tensor(out, data.device)


def inflate(stream: torch.Tensor, expected: int, *, at_most: bool = False) -> torch.Tensor:
    """Inverse of `deflate`; raises `PayloadError` unless the stream is well formed and
    expands to exactly `expected` bytes, or to at most `expected` with `at_most` (never
    inflates more than that)."""
    raw = stream.reshape(-1).cpu().numpy().tobytes()
    if len(raw) < _LENGTH.size:
        raise PayloadError(f"DEFLATE section holds {len(raw)} bytes, shorter than its "
                           f"{_LENGTH.size}-byte length field")
    (length,) = _LENGTH.unpack_from(raw)
    if length > expected or (length < expected and not at_most):
        raise PayloadError(f"DEFLATE section announces {length} bytes, expected "
                           f"{'at most ' if at_most else ''}{expected}")
    unpacker = zlib.decompressobj(-15)
    try:
        out = unpacker.decompress(raw[_LENGTH.size:], length)
    except zlib.error as err:
        raise PayloadError(f"DEFLATE section is corrupt: {err}") from None
    if len(out) != length or unpacker.unconsumed_tail or not unpacker.eof:
        raise PayloadError(f"DEFLATE section expands to {len(out)} bytes"
                           f"{' (truncated stream)' if not unpacker.eof else ''}"
                           f", its length field announces {length}")
    if unpacker.unused_data:
        raise PayloadError(f"DEFLATE section has {len(unpacker.unused_data)} bytes after the "
                           "end of its stream")
    return byte_tensor(out, stream.device)
