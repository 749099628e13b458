"""The benchmark entry point runs and writes its records."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_compressors_suite_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench", f"hydra.run.dir={tmp_path}",
         "sizes=[4096]", "distributions=[laplace,student_t]", "ratios=[0.01]", "repeats=1",
         "methods=[topk,randomk,none]"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = json.loads((tmp_path / "bench.json").read_text())
    assert {r["method"] for r in records} == {"topk", "randomk", "none"}
    topk = next(r for r in records if r["method"] == "topk")
    assert topk["payload_bytes"] == 8 * 40 and topk["quality"] == 1.0
    assert topk["read_s"] > 0 and topk["topk_s"] > 0
    assert "topk_speedup" in proc.stdout
