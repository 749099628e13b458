"""Order-preserving value codecs of DeepReduce (paper Sec. 3 and appendix Table 3): raw
float32, DEFLATE, and any per-tensor compressor of fixed size (`CompressorValues`), of
which fp16 and QSGD are the paper's two. The curve-fitting codecs are in
`gracecomm.compressors.deepreduce.fitting`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gracecomm.compressor import Compressor, TensorInfo
from gracecomm.compressors.cast import FP16
from gracecomm.compressors.deepreduce.codec import (
    VALUE_CODECS,
    CodecCtx,
    ValueCodec,
    f32_bytes,
    f32_values,
)
from gracecomm.compressors.dithering import QSGD
from gracecomm.compressors.shared.deflate import deflate, inflate
from gracecomm.pipeline import make_part
from gracecomm.registry import COMPRESSORS
from gracecomm.validation import ConfigError, PayloadError, check_range
from gracecomm.wire import from_bytes, to_bytes


@VALUE_CODECS.register("raw")
class RawValues(ValueCodec):
    """float32 values, 4n bytes."""

    codec_id = 1

    def encode(self, values: torch.Tensor, ctx: CodecCtx) -> tuple[torch.Tensor, None]:
        return f32_bytes(values), None

    def decode(self, section: torch.Tensor, n: int, ctx: CodecCtx) -> torch.Tensor:
        return f32_values(section, n, self.label)


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


@VALUE_CODECS.register("compressor")
class CompressorValues(ValueCodec):
    """Any per-tensor compressor of fixed size as the value codec: the bytes of its payload
    tensors one after another, split again on receipt by the compressor's `payload_spec` for
    n values, so no sizes travel. Its state is the compressor's own, not nested (the layout
    of checkpoint format 2); it is bound with the owning compressor (the rank keys any
    rounding noise)."""

    codec_id = 7
    child_attrs = ("compressor",)

    def __init__(self, compressor: str | Mapping[str, Any] | Compressor = "natural") -> None:
        self.compressor: Compressor = make_part(compressor, COMPRESSORS, Compressor)
        probe = TensorInfo(torch.Size([1]), torch.float32)
        if (self.compressor.capabilities().model_level
                or self.compressor.payload_spec(probe) is None):
            raise ConfigError(f"{self.label}: option 'compressor' must be a per-tensor "
                              "compressor that declares its payload layout (payload_spec: fp16, "
                              f"bf16, natural, the dithering family); got {self.compressor.label}")

    def encode(self, values: torch.Tensor, ctx: CodecCtx) -> tuple[torch.Tensor, None]:
        payload, _ = self.compressor.compress(values, ctx.name)
        return to_bytes(payload, values.device), None

    def decode(self, section: torch.Tensor, n: int, ctx: CodecCtx) -> torch.Tensor:
        info = TensorInfo(torch.Size([n]), torch.float32)
        spec = self.compressor.payload_spec(info)
        nbytes = sum(numel * dtype.itemsize for dtype, numel in spec)
        if section.numel() != nbytes:
            raise PayloadError(f"{self.label}: section holds {section.numel()} bytes, {n} "
                               f"values need {nbytes}")
        like = [torch.empty(0, dtype=dtype) for dtype, _ in spec]
        payload = tuple(from_bytes(section, [numel for _, numel in spec], like))
        return self.compressor.decompress(payload, info).float()

    def state_dict(self) -> dict[str, Any]:
        return self.compressor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.compressor.load_state_dict(state)


@VALUE_CODECS.register("fp16")
class FP16Values(CompressorValues):
    """IEEE half precision through the `fp16` compressor, 2n bytes; saturates at +-65504, so
    a finite value never becomes Inf."""

    codec_id = 2

    def __init__(self) -> None:
        super().__init__(FP16())


@VALUE_CODECS.register("qsgd")
class QSGDValues(CompressorValues):
    """QSGD (Alistarh et al. 2017) through the `qsgd` compressor
    (`gracecomm.compressors.dithering`): `levels` = 2^7 - 1 levels and one float32 l2 norm per
    bucket of `bucket` values, a sign plane and 7-bit level codes, so n + 4 ceil(n / bucket)
    bytes (up to one byte of padding); unbiased, rounding noise independent across ranks
    (options `rng` and `seed` as there)."""

    codec_id = 4
    run_keys = {"seed": "seed"}  # the run's seed (`gracecomm.configstore`)

    def __init__(self, levels: int = 127, bucket: int = 512, rng: str = "counter",
                 seed: int = 0) -> None:
        super().__init__(QSGD(levels, bucket, rng, seed))
