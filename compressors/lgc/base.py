"""What LGC_PS and LGC_RAR share: options, the three training phases, the autoencoder and its
optimizer, the one-time autoencoder transfer, the byte breakdown and the checkpoint state
(Abrahamyan et al., TNNLS, Secs. IV-C, V and VI-A, Algorithm 1, Tables IV and V).

Phases, with t the global step counted from 0 (identical on every rank):

1. t < warmup_iters: dense warm-up, every rank sends its whole gradient;
2. the next ae_train_iters steps: per-layer top-k, and one autoencoder step per iteration;
3. the rest: the frozen autoencoder codes the top-k vector.

LGC compresses whole models (``model_level``): the pipeline hands it every gradient of a step
in `compress_model`. The memory sees each tensor's top-k selection (F dense), so error
feedback keeps what top-k dropped; the autoencoder's reconstruction error is not fed back.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gracecomm.compressor import Compressor, Payload, TensorInfo
from gracecomm.compressors.lgc.autoencoder import Decoder, Encoder, pad, padded_length
from gracecomm.compressors.lgc.layout import Groups, IndexCoding, Plan
from gracecomm.sparse import DEFAULT_RATIO, desparsify, index_mask
from gracecomm.validation import (
    ConfigError,
    PayloadError,
    all_finite,
    check_choice,
    check_range,
    check_ratio,
    expect_payload,
)
from gracecomm.wire import payload_nbytes

SCALE_EPS = 1e-12



def expect_dense(payload: Payload, info: TensorInfo, what: str) -> None:
    """Raise `PayloadError` unless `payload` is one dense tensor of `info`'s size and dtype."""
    if len(payload) != 1:
        raise PayloadError(f"{what} has {len(payload)} tensors, expected 1 (dense phase)")
    expect_payload(payload[0], info.numel, info.dtype, what)

@dataclass(frozen=True, eq=False)
class LGCCtx:
    """Local context of one step's joint payload; what decompression reads from it (`plan`,
    `phase`, `step` and the variant's fields) is identical on every rank."""

    info: TensorInfo  # the flat model vector
    plan: Plan
    phase: int
    step: int


def options(owner: str, option: str, given: Mapping[str, Any] | None,
            defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`defaults` updated with `given`, refusing keys that are not in `defaults`."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(f"{owner}: option '{option}' has unknown keys {unknown}; allowed: "
                          f"{', '.join(defaults)}")
    return {**defaults, **given}


def groups_option(owner: str, option: str, value: Any) -> Groups:
    """'auto', None (no such group) or a list of parameter names / module prefixes."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"{owner}: option '{option}' must be 'auto', null or a list of parameter "
                      f"or module names, got {value!r}")


class LGC(Compressor):
    """Base of `lgc_ps` and `lgc_rar`. `ratio` is the paper's alpha: k_l = max(1,
    ceil(ratio * n_l)) per layer of M and Lambda."""

    model_level = True
    default_memory = "residual"
    state_attrs = ("step", "synced", "ae_skipped")  # and the autoencoder, below
    decoder_innovation: ClassVar[bool] = False
    # the density and phase lengths of the experiment that runs it, where it sets them
    run_keys: ClassVar[dict[str, str]] = {"ratio": "experiment.ratio",
                                          "warmup_iters": "experiment.warmup_iters",
                                          "ae_train_iters": "experiment.ae_train_iters"}
    AE_DEFAULTS: ClassVar[dict[str, Any]] = {
        "optimizer": "adam", "lr": 1e-3, "lambda1": 1.0, "leaky_slope": 0.01,
        "input_scale": "rms"}
    INDEX_CODING_DEFAULTS: ClassVar[dict[str, Any]] = asdict(IndexCoding())

    def __init__(self, ratio: float = DEFAULT_RATIO, warmup_iters: int = 200,
                 ae_train_iters: int = 300, first_layer: Any = "auto",
                 last_layer: Any = "auto", seed: int = 0,
                 index_coding: Mapping[str, Any] | None = None,
                 ae: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        label = self.label
        self.ratio = check_ratio(ratio, label)
        self.warmup_iters = check_range(warmup_iters, label, "warmup_iters", 0, integer=True)
        self.ae_train_iters = check_range(ae_train_iters, label, "ae_train_iters", 0,
                                          integer=True)
        self.first_layer = groups_option(label, "first_layer", first_layer)
        self.last_layer = groups_option(label, "last_layer", last_layer)
        self.seed = check_range(seed, label, "seed", 0, integer=True)
        coding = options(label, "index_coding", index_coding, self.INDEX_CODING_DEFAULTS)
        self.index_coding = IndexCoding(
            bool(coding["delta"]),
            check_range(coding["zlib_level"], label, "index_coding.zlib_level", 0, 9,
                        integer=True),
            check_choice(coding["format"], IndexCoding.FORMATS, label, "index_coding.format"))
        self.ae = options(label, "ae", ae, self.AE_DEFAULTS)
        check_choice(self.ae["optimizer"], ("adam", "sgd"), label, "ae.optimizer")
        check_choice(self.ae["input_scale"], ("rms", "none"), label, "ae.input_scale")
        check_range(self.ae["lr"], label, "ae.lr", 0.0, low_open=True)
        check_range(self.ae["leaky_slope"], label, "ae.leaky_slope", 0.0)
        for key in self.ae:
            if key.startswith("lambda"):
                check_range(self.ae[key], label, f"ae.{key}", 0.0)
        self.innovation_rule = ("fraction_of_topk", 0.1)  # m_l (Algorithm 1); used by lgc_ps
        self.step = 0
        self.synced = False  # the one-time autoencoder transfer at the start of phase 3
        self.ae_skipped = 0
        self.encoder: Encoder | None = None
        self.decoders: nn.ModuleList | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.ae_device = torch.device("cpu")
        self._plan: Plan | None = None

    # -- ranks ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.comm.rank if self.comm is not None else 0

    @property
    def world_size(self) -> int:
        return self.comm.world_size if self.comm is not None else 1

    # -- phases (Sec. VI-A, Table V) ----------------------------------------------------------
    def phase_at(self, step: int) -> int:
        """1 (dense warm-up), 2 (top-k + autoencoder training) or 3 (compressed)."""
        if step < self.warmup_iters:
            return 1
        return 2 if step < self.warmup_iters + self.ae_train_iters else 3

    @property
    def phase(self) -> int:
        """The phase of the next step."""
        return self.phase_at(self.step)

    # -- the pipeline's entry points ------------------------------------------------------------
    def plan(self, named: Sequence[tuple[str, torch.Tensor]]) -> Plan:
        """The partition and sizes for these tensors (rebuilt when they change)."""
        names = tuple(name for name, _ in named)
        shapes = tuple(t.shape for _, t in named)
        if self._plan is None or self._plan.names != names or self._plan.shapes != shapes:
            self._plan = Plan.build(names, shapes, self.ratio, self.first_layer, self.last_layer,
                                    self.innovation_rule)
        return self._plan

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        """One tensor as a whole model (the pipeline calls `compress_model`)."""
        _, payload, ctx = self.compress_model([(name, tensor)])
        return payload, ctx

    def compress_model(self, named: Sequence[tuple[str, torch.Tensor]]
                       ) -> tuple[list[tuple[Payload, Any]], Payload, Any]:
        dtypes = {t.dtype for _, t in named}
        if len(dtypes) > 1:
            raise TypeError(f"{self.label} concatenates all gradients, which must share one "
                            f"dtype; got {', '.join(f'{n}: {t.dtype}' for n, t in named)}")
        plan = self.plan(named)
        tensors = [t for _, t in named]
        phase = self.phase
        self.ensure_autoencoder(tensors[0].device)
        if phase == 3 and not self.synced:
            self.sync_autoencoder()
        self.metrics.add("lgc_phase", phase)
        info = TensorInfo(torch.Size([plan.n]), tensors[0].dtype)
        if phase == 1:
            views = plan.views(tensors, None)
            payload: Payload = (torch.cat([t.reshape(-1) for t in tensors]),)
            ctx: LGCCtx = LGCCtx(info, plan, 1, self.step)
            self.log_parts(("dense",), payload)
        else:
            views, payload, ctx = self.compress_sparse(plan, tensors, info, phase)
        self.step += 1
        return views, payload, ctx

    @abstractmethod
    def compress_sparse(self, plan: Plan, tensors: Sequence[torch.Tensor], info: TensorInfo,
                        phase: int) -> tuple[list[tuple[Payload, Any]], Payload, LGCCtx]:
        """Phases 2 and 3: (memory views, joint payload, ctx)."""

    def transmitted(self, payload: Payload, ctx: Any) -> torch.Tensor:
        if isinstance(ctx, TensorInfo) and len(payload) == 1:  # a dense layer or phase
            return torch.ones(ctx.numel, dtype=torch.bool, device=payload[0].device)
        if isinstance(ctx, TensorInfo):
            return index_mask(payload[1], ctx.numel)
        return super().transmitted(payload, ctx)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        if isinstance(ctx, TensorInfo):  # one tensor's selection, as the memory sees it
            if len(payload) == 1:
                return payload[0].view(ctx.shape)
            return desparsify(payload[0], payload[1], ctx)
        return self.decode(payload, ctx)

    @abstractmethod
    def decode(self, payload: Payload, ctx: LGCCtx) -> torch.Tensor:
        """The flat model vector of a joint payload."""

    # -- the leader's selection (Sec. V-A, Fig. 7) ----------------------------------------------
    def leader_indices(self, plan: Plan, tensors: Sequence[torch.Tensor],
                       leader: int) -> tuple[list[torch.Tensor], int]:
        """The leader's per-layer top-k indices and the length of their DEFLATE stream, which
        the leader broadcasts (its length first, as a size header) and is charged for as
        ``lgc_index_bytes``."""
        device = tensors[0].device
        stream = None
        if self.rank == leader:
            indices = plan.topk(tensors)
            with self.metrics.timer("deflate_s"):
                stream = plan.encode_indices(indices, self.index_coding)
            self.log_bytes("index", stream)
        if self.comm is None:
            return indices, stream.numel()
        length = self.comm.gather_sizes([stream.numel() if stream is not None else 0],
                                        device)[leader][0]
        buf = stream if stream is not None else torch.empty(length, dtype=torch.uint8,
                                                            device=device)
        self.comm.broadcast(buf, leader)
        if self.rank == leader:
            return indices, length
        try:
            return plan.decode_indices(buf, self.index_coding), length
        except PayloadError as err:
            raise PayloadError(f"index stream from the leader, rank {leader}: {err}") from None

    # -- autoencoder (Sec. IV-C) ----------------------------------------------------------------
    def decoder_count(self) -> int:
        return 1

    def ensure_autoencoder(self, device: torch.device, decoders: int | None = None) -> None:
        """Build the encoder, the decoder(s) and their optimizer (seeded, so identical on
        every rank) on first use, and keep them on `device`."""
        if self.encoder is None:
            slope = float(self.ae["leaky_slope"])
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                self.encoder = Encoder(slope)
                self.decoders = nn.ModuleList(
                    Decoder(slope, self.decoder_innovation)
                    for _ in range(decoders or self.decoder_count()))
            params = [*self.encoder.parameters(), *self.decoders.parameters()]
            lr = float(self.ae["lr"])
            self.optimizer = (torch.optim.Adam(params, lr=lr) if self.ae["optimizer"] == "adam"
                              else torch.optim.SGD(params, lr=lr))
            self.ae_device = torch.device("cpu")
        if self.ae_device != device:  # modules move in place; the optimizer keeps its params
            self.encoder.to(device)
            self.decoders.to(device)
            self.ae_device = device

    @staticmethod
    def rms(vectors: torch.Tensor) -> torch.Tensor:
        """Root mean square of each row, shape (..., 1), float32."""
        return vectors.float().pow(2).mean(-1, keepdim=True).sqrt()

    def scale(self, vectors: torch.Tensor) -> torch.Tensor:
        """Per row: s = RMS + 1e-12 with ``input_scale: rms``, else 1 (shape (..., 1))."""
        if self.ae["input_scale"] == "none" or vectors.shape[-1] == 0:
            return torch.ones(*vectors.shape[:-1], 1, device=vectors.device)
        return self.rms(vectors) + SCALE_EPS

    def encode(self, vectors: torch.Tensor, plan: Plan) -> torch.Tensor:
        """E(pad(x)) for rows x of length mu: (B, 4, mu_pad/16), float32."""
        return self.encoder(pad(vectors.float(), padded_length(plan.mu)))

    def train_step(self, loss: Callable[[], torch.Tensor]) -> None:
        """One optimizer step on the autoencoder; a non-finite loss skips it (counted)."""
        with self.metrics.timer("ae_s"), torch.enable_grad():
            self.optimizer.zero_grad(set_to_none=True)
            value = loss()
            if not bool(torch.isfinite(value)):
                self.ae_skipped += 1
                self.metrics.add("ae_skipped", 1)
                return
            value.backward()
            self.optimizer.step()
        self.metrics.add("ae_loss", value.item())

    @abstractmethod
    def sync_source(self) -> tuple[int, list[nn.Module]]:
        """The rank that trained the autoencoder and the modules the others need."""

    def sync_autoencoder(self) -> None:
        """The one-time transfer when phase 2 ends (Sec. V-B): broadcast the trained
        weights from their trainer, counted as that rank's payload and as ``ae_sync_bytes``."""
        src, modules = self.sync_source()
        params = [p for m in modules for p in m.parameters()]
        flat = nn.utils.parameters_to_vector(params).detach()
        if self.comm is not None:
            self.comm.broadcast(flat, src)
        if self.rank == src:
            self.metrics.add("ae_sync_bytes", payload_nbytes([flat]))
        with torch.no_grad():
            nn.utils.vector_to_parameters(flat, params)
        self.synced = True

    def check_reconstruction(self, x: torch.Tensor) -> torch.Tensor:
        if not all_finite(x):
            raise FloatingPointError(f"{self.label}: the autoencoder's phase-3 reconstruction "
                                     f"holds NaN or Inf at step {self.step}")
        return x

    # -- accounting (Sec. VI, Table IV) ----------------------------------------------------------
    def log_parts(self, parts: Sequence[str], payload: Payload) -> None:
        """Bytes of each payload tensor under ``lgc_<part>_bytes`` (dense, latent, values,
        innovation, index, scalars); together with the bytes of the compressor's own
        collectives they add up to ``wire_bytes``."""
        for part, tensor in zip(parts, payload, strict=True):
            self.log_bytes(part, tensor)

    def log_bytes(self, part: str, tensor: torch.Tensor) -> None:
        self.metrics.add(f"lgc_{part}_bytes", payload_nbytes([tensor]))

    def log_topk_baseline(self, plan: Plan, dense: torch.Tensor, index_bytes: int) -> None:
        """What plain Top-k on LGC's partition would send from this rank this step (Table
        IV's top-k rows, index bytes counted): F dense and the mu + kappa selected values, with the
        indices DEFLATE-coded as LGC codes them (`index_bytes`: this step's stream, the rank's
        own or the leader's, whose length every rank knows) in ``lgc_topk_deflate_nbytes``,
        or as int32 in ``lgc_topk_int32_nbytes``. Not part of ``wire_bytes``."""
        values = (plan.mu + plan.kappa) * dense.element_size() + payload_nbytes([dense])
        self.metrics.add("lgc_topk_deflate_nbytes", values + index_bytes)
        self.metrics.add("lgc_topk_int32_nbytes", values + 4 * (plan.mu + plan.kappa))

    # -- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """With the autoencoder and its optimizer once they exist."""
        state = super().state_dict()
        if self.encoder is not None:  # copies: the autoencoder trains in place
            state["encoder"] = copy.deepcopy(self.encoder.state_dict())
            state["decoders"] = [copy.deepcopy(d.state_dict()) for d in self.decoders]
            state["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if "encoder" in state:
            device = state["encoder"]["net.0.weight"].device
            self.encoder = None
            self.ensure_autoencoder(device, decoders=len(state["decoders"]))
            self.encoder.load_state_dict(state["encoder"])
            for decoder, weights in zip(self.decoders, state["decoders"]):
                decoder.load_state_dict(weights)
            self.optimizer.load_state_dict(state["optimizer"])
