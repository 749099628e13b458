"""Order-preserving value codecs of DeepReduce (paper Sec. 3 and appendix Table 3): raw
float32, fp16, DEFLATE and QSGD. The curve-fitting codecs are in
`gracecomm.compressors.deepreduce.fitting`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from grace.compressor import TensorInfo
from gracecomm.compressors.shared.deflate import deflate, inflate
from grace.validation import PayloadError, check_range
from grace.wire import packed_nbytes, to_bytes
from gracecomm.compressors.cast import FP16
from gracecomm.compressors.deepreduce.codec import (VALUE_CODECS, CodecCtx, ValueCodec, f32_bytes,
                                          f32_values)
from gracecomm.compressors.dithering import QSGD


@VALUE_CODECS.register("raw")
class RawValues(ValueCodec):
    """float32 values, 4n bytes."""

    codec_id = 1

    def encode(self, values: torch.Tensor, ctx: CodecCtx) -> tuple[torch.Tensor, None]:
        return f32_bytes(values), None

    def decode(self, section: torch.Tensor, n: int, ctx: CodecCtx) -> torch.Tensor:
        return f32_values(section, n, self.label)


@VALUE_CODECS.register("fp16")
class FP16Values(ValueCodec):
    """IEEE half precision, 2n bytes; saturates at +-65504 like the `fp16` compressor (whose
    cast it uses), so a finite value never becomes Inf."""

    codec_id = 2

    def __init__(self) -> None:
        self.cast = FP16()

    def encode(self, values: torch.Tensor, ctx: CodecCtx) -> tuple[torch.Tensor, None]:
        (half,), _ = self.cast.compress(values, ctx.name)
        return half.view(torch.uint8), None

    def decode(self, section: torch.Tensor, n: int, ctx: CodecCtx) -> torch.Tensor:
        if section.numel() != 2 * n:
            raise PayloadError(f"{self.label}: section holds {section.numel()} bytes, {n} "
                               f"values need {2 * n}")
        return section.clone().view(torch.float16).float()


@VALUE_CODECS.register("deflate")
class DeflateValues(ValueCodec):
    """DEFLATE (zlib level `level`) over the float32 bytes; CPU."""

    codec_id = 3

    def __init__(self, level: int = 6) -> None:
        self.level = check_range(level, self.label, "level", 0, 9, integer=True)

    def encode(self, values: torch.Tensor, ctx: CodecCtx) -> tuple[torch.Tensor, None]:
        return deflate(f32_bytes(values), self.level), None

    def decode(self, section: torch.Tensor, n: int, ctx: CodecCtx) -> torch.Tensor:
        return f32_values(inflate(section, 4 * n), n, self.label)


@VALUE_CODECS.register("qsgd")
class QSGDValues(ValueCodec):
    """QSGD (Alistarh et al. 2017) through the `qsgd` compressor (`gracecomm.compressors.dithering`):
    `levels` = 2^7 - 1 levels and one float32 l2 norm per bucket of `bucket` values, a sign
    plane and 7-bit level codes, so n + 4 ceil(n / bucket) bytes (up to one byte of padding);
    unbiased, rounding noise independent across ranks (options `rng` and `seed` as there)."""

    codec_id = 4
    child_attrs = ("qsgd",)  # bound with the owning compressor (the rank keys the noise)

    def __init__(self, levels: int = 127, bucket: int = 512, rng: str = "counter",
                 seed: int = 0) -> None:
        self.qsgd = QSGD(levels, bucket, rng, seed)

    def encode(self, values: torch.Tensor, ctx: CodecCtx) -> tuple[torch.Tensor, None]:
        payload, _ = self.qsgd.compress(values, ctx.name)
        return to_bytes(payload, values.device), None

    def decode(self, section: torch.Tensor, n: int, ctx: CodecCtx) -> torch.Tensor:
        buckets = self.qsgd.buckets(n)[1] if n else 0
        sizes = [4 * buckets, packed_nbytes(n, 1), packed_nbytes(n, self.qsgd.code_bits)]
        if section.numel() != sum(sizes):
            raise PayloadError(f"{self.label}: section holds {section.numel()} bytes, {n} "
                               f"values need {sum(sizes)}")
        norms, signs, codes = torch.split(section, sizes)
        norms = f32_values(norms, buckets, self.label)
        return self.qsgd.decompress((norms, signs, codes), TensorInfo(torch.Size([n]),
                                                                       torch.float32))

    def state_dict(self) -> dict[str, Any]:
        """The QSGD stage's state itself, not nested: the layout of checkpoint format 2."""
        return self.qsgd.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.qsgd.load_state_dict(state)
