"""Suite ``lgc``: the per-step cost of LGC's phases next to plain Top-k on one model's
gradients, in one process (a world of one rank: the PS master decodes one worker).

    gracecomm-bench suite=lgc
    gracecomm-bench suite=lgc +lgc.models=[resnet20,reference_cnn] +lgc.ratio=0.001
    gracecomm-bench suite=lgc +lgc.index_coding.format=varint  # LGC's options, e.g. varint indices

Each method runs whole pipeline steps (memory, compression, exchange, decompression; for LGC
the autoencoder's training step in phase 2, its encoder and decoder in phase 3) on seeded
random gradients of the model's shapes. ``step_s`` is the best of ``repeats`` steps, with that
step's ``compress_s``, ``decompress_s``, ``ae_s`` and ``deflate_s`` (the index streams' DEFLATE,
coded as LGC's ``index_coding`` option says, which ``+lgc.index_coding`` overrides);
``topk_speedup`` is Top-k's step time over the method's, measured in the same run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

import gracecomm
from gracecomm.config import instantiate
from gracecomm.experiments.bench import Record, suite, suite_options

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULTS = {"models": ["resnet20"], "ratio": 0.01, "index_coding": {}}


def time_steps(g: gracecomm.Grace, named: list[tuple[str, torch.Tensor]],
               repeats: int) -> dict[str, float]:
    """The fastest of `repeats` steps (after one warm-up step) and its statistics."""
    g.step_many(named)
    g.metrics.pop()
    best: dict[str, float] = {"step_s": float("inf")}
    for _ in range(repeats):
        start = time.perf_counter()
        g.step_many(named)
        elapsed = time.perf_counter() - start
        stats = g.metrics.pop()
        if elapsed < best["step_s"]:
            best = {**stats, "step_s": elapsed}
    return best


def methods(ratio: float, index_coding: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Top-k and each LGC variant pinned to phase 2 (training) or phase 3 (compressed), with
    LGC's `index_coding` options (empty: its defaults)."""
    out: dict[str, dict[str, Any]] = {"topk": {"name": "topk", "ratio": ratio}}
    coding = {"index_coding": dict(index_coding)} if index_coding else {}
    for name in ("lgc_rar", "lgc_ps"):
        out[f"{name} phase 2"] = {"name": name, "ratio": ratio, "warmup_iters": 0,
                                  "ae_train_iters": 10**9, **coding}
        out[f"{name} phase 3"] = {"name": name, "ratio": ratio, "warmup_iters": 0,
                                  "ae_train_iters": 0, **coding}
    return out


@suite("lgc")
def run(cfg: DictConfig) -> list[Record]:
    options = suite_options(cfg, "lgc", DEFAULTS)
    torch.manual_seed(int(cfg.seed))
    records = []
    for model_name in options["models"]:
        model = instantiate(OmegaConf.load(CONFIG_DIR / "model" / f"{model_name}.yaml"))
        named = [(n, torch.randn_like(p)) for n, p in model.named_parameters()]
        numel = sum(t.numel() for _, t in named)
        topk_s = None
        for label, spec in methods(float(options["ratio"]), options["index_coding"]).items():
            best = time_steps(gracecomm.build(spec), named, int(cfg.repeats))
            topk_s = topk_s or best["step_s"]
            records.append({"method": label, "model": model_name, "numel": numel,
                            "ratio": float(options["ratio"]), "step_s": best["step_s"],
                            "compress_s": best.get("compress_s", 0.0),
                            "decompress_s": best.get("decompress_s", 0.0),
                            "ae_s": best.get("ae_s", 0.0),
                            "deflate_s": best.get("deflate_s", 0.0),
                            "payload_bytes": best.get("wire_bytes", 0.0),
                            "topk_speedup": topk_s / best["step_s"]})
    return records
