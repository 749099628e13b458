"""The report of ``gracecomm-gpucheck`` (`gracecomm.experiments.checks.gpucheck`): the
Markdown page (`markdown`: the machine, one row per method, the DDP runs, the details of
every method that is not bit-identical or leaves the device) and the JSON line printed last
(`summary_line`)."""

from __future__ import annotations

import json
from typing import Any

Record = dict[str, Any]


def sync_cells(syncs: dict[str, float]) -> str:
    """Syncs per call of compress/decompress/aggregate/pipeline step ('-': not run)."""
    return "/".join("-" if p not in syncs else f"{syncs[p]:g}"
                    for p in ("compress", "decompress", "aggregate", "pipeline"))


def summary_line(report: Record) -> Record:
    """The JSON line printed last."""
    def timing(rec: Record, key: str) -> dict[str, float | None]:
        return {n: t.get(key) for n, t in rec.get("timing", {}).items()}

    return {"device": report["device"], "ok": report["ok"],
            "machine": report["machine"].get("name"),
            "compressors": {label: {"agree": m["agree"], "on_device": m.get("on_device"),
                                    "syncs": sum(m.get("syncs", {}).get(p, 0)
                                                 for p in ("compress", "decompress")),
                                    "x_read": timing(m, "x_read"),
                                    "vs_topk": timing(m, "vs_topk"), "ok": m["ok"]}
                            for label, m in report["methods"].items()},
            "ddp": {"backend": report["ddp"].get("backend"), "ok": report["ddp"]["ok"],
                    "runs": {k: {"ok": r["ok"], "steps": r.get("steps"),
                                 "loss_last": r.get("loss_last")}
                             for k, r in report["ddp"]["runs"].items()}}}


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: Record, command: str) -> str:
    """The report as markdown: the machine, one row per method, the DDP runs, the details
    of every method that is not bit-identical or leaves the device."""
    m = report["machine"]
    sizes = [str(n) for n in report["config"]["sizes"]]
    lines = [f"# gracecomm-gpucheck: {'PASSED' if report['ok'] else 'FAILED'}", "",
             f"Command: `{command}`", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in m.items())
             + f"; the check took {report['seconds']:.0f} s.", "",
             "Agreement with the CPU path, placement, host syncs per call of compress, "
             "decompress, aggregate (two payloads) and a step of the whole pipeline, and "
             "compress + "
             "decompress time in reads of the tensor (`x_read`) and in times of "
             "`torch.topk` (`vs_topk`, below 1 is faster) at " + ", ".join(sizes) +
             " elements.", "",
             "| method | agree | expect | on device | syncs c/d/a/p | "
             + " | ".join(f"x_read {n} | vs_topk {n}" for n in sizes) + " | ok |",
             "|" + "---|" * (6 + 2 * len(sizes))]
    for label, r in report["methods"].items():
        timing = r.get("timing", {})
        cells = []
        for n in sizes:
            t = timing.get(n, {})
            cells += [_num(t.get("x_read"), 1), _num(t.get("vs_topk"), 2)]
        lines.append(f"| {label} | {r['agree']} | {r.get('expect', '-')} | "
                     f"{r.get('on_device', '-')} | {sync_cells(r.get('syncs', {}))} | "
                     + " | ".join(cells) + f" | {'yes' if r['ok'] else '**no**'} |")
    ddp = report["ddp"]
    if ddp["runs"]:
        lines += ["", f"DDP hook: {ddp['world_size']} ranks over {ddp['backend']} on "
                  f"{ddp['device']} ({ddp['gpus']} GPUs), {ddp['steps']} steps each.", "",
                  "| method | ok | steps | first loss | last loss | wire bytes/step | s |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in ddp["runs"].items():
            lines.append(f"| {name} | {'yes' if r['ok'] else '**no**'} | {r.get('steps', '-')} "
                         f"| {_num(r.get('loss_first'), 3)} | {_num(r.get('loss_last'), 3)} "
                         f"| {r.get('wire_bytes_per_step', '-')} | {r['seconds']:.0f} |")
    details = [(label, r) for label, r in report["methods"].items()
               if r["agree"] != "identical" or not r.get("on_device") or r.get("sync_sites")
               or r.get("host_copies")]
    if details:
        lines += ["", "## Details", ""]
        for label, r in details:
            lines.append(f"- **{label}** ({r['agree']}): " + "; ".join(
                f"{k}: {json.dumps(r[k])}" for k in ("reason", "random_parts", "misplaced",
                                                     "numpy", "host_tensors", "sync_sites",
                                                     "cuda_syncs", "host_copies",
                                                     "host_copy_sites")
                if r.get(k)))
            if r["agree"] not in ("identical", "cannot build", "cannot run"):
                lines.append(f"  worst comparison: {json.dumps(r['worst'])}")
    for name, r in ddp["runs"].items():
        if not r["ok"]:
            lines += ["", f"DDP {name} failed:", "", "```", r.get("error", ""), "```"]
    return "\n".join(lines) + "\n"
