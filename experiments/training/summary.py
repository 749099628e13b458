"""A run's totals and summary: per-step statistics summed over the steps (`accumulate`),
their per-rank, per-step means with the network projection (`summarize`), the summary rank 0
prints (`format_summary`), and the objective a Hydra sweeper minimises (`objective`)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from gracecomm.network import (
    COLLECTIVE_KEYS,
    LEVEL_KEYS,
    NODE_COLLECTIVE_KEYS,
    Network,
    overhead_time,
    project,
)
from gracecomm.validation import (
    ConfigError,
    check_choice,
)

SUMMED_KEYS = ("dense_bytes", "wire_bytes", "sent_bytes", "downlink_bytes", "compress_s",
               "decompress_s", "memory_s", "comm_s", "step_s", "exchanges", *COLLECTIVE_KEYS,
               *LEVEL_KEYS, *NODE_COLLECTIVE_KEYS)
STARTUP = "startup_"  # prefix of the totals of start-up steps (see `accumulate`)


def measured_speedup(summary: dict[str, Any], dense_s: float) -> dict[str, float]:
    """The speedup measured on this run's own network: its mean step against the same
    step's computation plus one dense allreduce of the gradients timed in the run
    (`time_dense_allreduce`); nothing without peers."""
    if not dense_s:
        return {}
    step = summary["step_s_per_step"]
    compute = max(0.0, step - summary["comm_s_per_step"] - summary["overhead_s_per_step"])
    return {"dense_allreduce_s": dense_s,
            "measured_speedup": (compute + dense_s) / step if step > 0 else 1.0}


def tensor_bytes(state: Any) -> int:
    """Bytes of all tensors in a nested state dict (compression state that must not grow)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0


def new_totals() -> dict[str, float]:
    """Zeroed run totals: every summed statistic, over all steps and over start-up steps."""
    return dict.fromkeys([*SUMMED_KEYS, *(STARTUP + k for k in SUMMED_KEYS), "startup_steps"],
                         0.0)


def accumulate(totals: dict[str, float], stats: dict[str, float], startup: bool) -> None:
    """Add one step's statistics to the run's totals. The first step a process runs is also
    summed apart as start-up (numba kernels load or compile, buffers and DDP buckets are
    built: seconds that would otherwise skew every per-step mean of a short run)."""
    for key in SUMMED_KEYS:
        totals[key] += stats.get(key, 0.0)
        if startup:
            totals[STARTUP + key] += stats.get(key, 0.0)
    totals["startup_steps"] += int(startup)


def summarize(totals: dict[str, float], steps: int, world_size: int, device: torch.device,
             nets: list[Network]) -> dict[str, float]:
    """Per-rank, per-step means over all ranks of the summed statistics, taken over the
    steady-state steps (all but the start-up steps, unless the run has no other), the network
    projection (gracecomm.network) of those means, and the start-up steps' own figures."""
    keys = list(totals)
    vec = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(vec)
    total = {k: float(v) / world_size for k, v in zip(keys, vec.tolist())}
    startup = round(total["startup_steps"]) if steps > total["startup_steps"] else 0
    steady = steps - startup
    means = {k: (total[k] - (total[STARTUP + k] if startup else 0.0)) / max(1, steady)
             for k in SUMMED_KEYS}
    summary = {f"{k}_per_step": v for k, v in means.items()}
    wire, down = means["wire_bytes"], means["downlink_bytes"]
    summary["compression_factor"] = means["dense_bytes"] / wire if wire else math.inf
    if down:  # a parameter server's reply, which every rank receives
        summary["compression_factor_down"] = means["dense_bytes"] / down
    summary["overhead_s_per_step"] = overhead_time(means)
    summary.update(project(means, world_size, nets))
    summary.update(steady_steps=steady, startup_steps=startup,
                   startup_step_s=total[STARTUP + "step_s"] if startup else 0.0,
                   startup_overhead_s=overhead_time(
                       {k: total[STARTUP + k] for k in SUMMED_KEYS}) if startup else 0.0)
    return summary


def format_bytes(n: float) -> str:
    """Decimal units, as the network model's bandwidths: 1 KB = 1,000 bytes."""
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} GB"


def summary_lines(s: dict[str, Any], run_dir: str) -> list[str]:
    """What rank 0 prints at the end of a run (and the run log keeps): the summary and, when
    the run collapsed, why."""
    lines = [format_summary(s, run_dir)]
    if s.get("collapse"):
        lines.append(f"!! {s['collapse']['message']}")
    return lines


def format_summary(s: dict[str, Any], run_dir: str) -> str:
    def row(label: str, text: str) -> str:
        return f"   {label:<22} {text}"

    down = s.get("downlink_bytes_per_step", 0.0)
    lines = [f"== {s['compressor']} + {s['memory']} memory over {s['communicator']}, "
             f"{s['world_size']} ranks, {s['steps']} steps",
             row(s["metric_label"], f"{s.get(s['metric'], float('nan')):.4f}"),
             row("uplink / step" if down else "wire bytes / step",
                 f"{format_bytes(s['wire_bytes_per_step'])} per rank (dense "
                 f"{format_bytes(s['dense_bytes_per_step'])}, compression factor "
                 f"{s['compression_factor']:.1f}x)")]
    if down:
        lines.append(row("downlink / step", f"{format_bytes(down)} to every rank (compression "
                                            f"factor {s['compression_factor_down']:.1f}x)"))
    if s.get("intra_node_bytes_per_step"):  # the two-level exchange (exchange.hierarchy=node)
        lines.append(row("per level / step",
                         f"{format_bytes(s['cross_node_bytes_per_step'])} across nodes, "
                         f"{format_bytes(s['intra_node_bytes_per_step'])} inside the node, "
                         "per rank"))
    lines += [
        row("compression / step", f"{1e3 * s['overhead_s_per_step']:.2f} ms (compress "
                                  f"{1e3 * s['compress_s_per_step']:.2f}, decompress "
                                  f"{1e3 * s['decompress_s_per_step']:.2f}, memory "
                                  f"{1e3 * s['memory_s_per_step']:.2f})"),
        row("communication / step", f"{1e3 * s['comm_s_per_step']:.2f} ms"),
        row("projected speedup", ", ".join(f"{v:.2f}x at {k.split('@')[1]}" for k, v in s.items()
                                           if k.startswith("speedup@"))
            + " (vs dense ring allreduce)"),
    ]
    if "measured_speedup" in s:
        lines.append(row("measured speedup",
                         f"{s['measured_speedup']:.2f}x on this run's network (vs a dense "
                         f"allreduce timed in the run: {1e3 * s['dense_allreduce_s']:.2f} ms)"))
    lines += [row("per-step figures", steady_steps_text(s)),
              row("metrics", os.path.join(run_dir, "metrics.jsonl")),
              bought(s)]
    return "\n".join(lines)


def bought(s: dict[str, Any]) -> str:
    """The summary's last line: what compression bought, in bytes and in projected step
    time on the slowest and fastest modelled networks."""
    factor = s["compression_factor"]
    if not math.isfinite(factor) or abs(factor - 1.0) < 0.005:
        return (f"== compression bought nothing: {s['compressor']} sends what dense "
                "allreduce sends (try compressor=topk)")
    speedups = [(k.split("@")[1], v) for k, v in s.items() if k.startswith("speedup@")]
    text = (f"== compression bought {factor:.1f}x fewer bytes than dense allreduce"
            if factor > 1 else f"== compression cost {1 / factor:.1f}x more bytes than dense "
            "allreduce")
    if speedups:
        (slow, first), (fast, last) = speedups[0], speedups[-1]
        text += f"; projected speedup {first:.2f}x at {slow}"
        if fast != slow:
            text += f", {last:.2f}x at {fast}"
    return text


# What `main` returns to a Hydra sweeper such as Optuna, every one minimised: `error` is 1 -
# the test metric where higher is better (accuracy, hit rate) and the test metric itself
# where lower is better (perplexity); the others are bytes per rank per step (payload; sent,
# with size headers and padding).
OBJECTIVES = ("error", "wire_bytes", "sent_bytes")


def objective_names(cfg: DictConfig) -> list[str]:
    """``objective``: one name of `OBJECTIVES` or a list of them (Optuna's multi-objective
    mode)."""
    names = cfg.get("objective", "error")
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ConfigError(f"option 'objective' is empty; give one or more of "
                          f"{', '.join(OBJECTIVES)}")
    return [check_choice(name, OBJECTIVES, "config", "objective") for name in names]


def objective(summary: dict[str, Any], names: list[str]) -> float | tuple[float, ...]:
    """The run's value of each objective in `names`, all to be minimised (a float for one
    name, a tuple for several); NaN for a run that wrote no summary."""
    values = []
    for name in names:
        if name == "error":
            metric = float(summary.get(summary.get("metric", ""), math.nan))
            values.append(1.0 - metric if summary.get("higher_is_better", True) else metric)
        else:
            values.append(float(summary.get(f"{name}_per_step", math.nan)))
    return values[0] if len(values) == 1 else tuple(values)


def steady_steps_text(s: dict[str, Any]) -> str:
    """Which steps the per-step figures average, and what the start-up steps cost."""
    startup, steps = s.get("startup_steps", 0), s["steps"]
    if not startup:
        return f"means over all {steps} steps"
    which = (f"steps 2-{steps}; start-up (step 1)" if startup == 1 else
             f"{s['steady_steps']} steady-state steps; start-up (the first step of each of "
             f"{startup} process starts)")
    return (f"means over {which} took {s['startup_step_s']:.2f} s, of it compression "
            f"{s['startup_overhead_s']:.2f} s")
