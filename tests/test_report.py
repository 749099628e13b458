"""The sweep report: tables, labels, Pareto front and plots from JSONL runs, on a tiny real
multirun of the entry point (which writes its report through the Hydra callback) and on
hand-written runs."""

import csv
import json

import pytest

from gracecomm.experiments.reports.plots import pareto_front, plot_labels
from gracecomm.experiments.reports.report import main
from gracecomm.experiments.reports.tables import describe, load_runs
from gracecomm.experiments.reports.writer import log_to_wandb, write_report
from gracecomm.experiments.training.loggers import JsonlLogger
from tests.test_train import train


@pytest.mark.slow
def test_multirun_writes_its_report(tmp_path):
    proc = train(tmp_path, "model=ncf", "data=implicit_feedback", "data.num_users=150",
                 "data.num_items=300", "trainer.max_steps=6",
                 "+method=dense,topk10", multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "sweep"
    assert "report: " in proc.stdout
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*_*/summary.json"))]
    assert [r["compressor"] for r in rows] == ["none", "topk(ratio=0.1)"]
    for row, summary in zip(rows, summaries):
        assert summary["metric"] == "test_hr@10"
        assert float(row["test_hr@10"]) == pytest.approx(summary["test_hr@10"])
        assert float(row["wire_bytes/step"]) == pytest.approx(summary["wire_bytes_per_step"])
        for net in ("0.1Gbps", "1Gbps", "10Gbps"):
            assert float(row[f"speedup@{net}"]) == pytest.approx(summary[f"speedup@{net}"])
    assert float(rows[1]["compression_factor"]) > 4 and rows[0]["compression_factor"] == "1.0"
    assert "downlink_bytes/step" not in rows[0]  # allreduce and allgather: one direction
    for plot in ("pareto", "overhead", "speedup", "loss", "quality"):  # topk logs k_hat/k
        assert (sweep / f"{plot}.png").stat().st_size > 1000, plot
    markdown = (sweep / "report.md").read_text()
    assert "| 1_topk | topk(ratio=0.1) | residual | allgather |" in markdown

    main([str(sweep / "1_topk"), "--out", str(tmp_path / "one"), "--no-plots"])
    assert len(list(csv.DictReader((tmp_path / "one" / "report.csv").open()))) == 1


def fake_run(path, compressor, ratio, metric_value, wire, quality=None, **summary):
    config = {"compressor": {"_target_": f"gracecomm.compressors.{compressor}", "ratio": ratio,
                             "seed": 0},
              "memory": {"_target_": "gracecomm.memories.residual.ResidualMemory", "beta": 1.0},
              "trainer": {"lr": 0.1, "progress": False}}
    log = JsonlLogger(str(path), config)
    for step in range(1, 5):
        log.log({"type": "step", "step": step, "loss": 1.0 / step, "wire_bytes": wire,
                 **({"quality": quality} if quality else {})})
    log.log({"type": "eval", "step": 4, "test_ppl": metric_value})
    log.finish({"compressor": compressor, "memory": "residual", "communicator": "allgather",
                "metric": "test_ppl", "test_ppl": metric_value, "higher_is_better": False,
                "wire_bytes_per_step": wire, "steps": 4, "speedup@1Gbps": 1.5, **summary})


def test_report_from_hand_written_runs(tmp_path):
    fake_run(tmp_path / "0_a", "topk", 0.1, 50.0, 1000.0, quality=1.0)
    fake_run(tmp_path / "1_b", "topk", 0.01, 80.0, 100.0, quality=0.9)
    fake_run(tmp_path / "2_c", "dgc", 0.01, 90.0, 500.0)      # dominated: more bytes, worse
    (tmp_path / "3_crashed").mkdir()
    (tmp_path / "3_crashed" / "metrics.jsonl").write_text('{"type": "config", "config": {}}\n')
    assert [r.path.name for r in load_runs(tmp_path)] == ["0_a", "1_b", "2_c"]
    report = write_report(tmp_path, tmp_path / "out")
    rows = report.table.rows
    assert [r["compressor"] for r in rows] == ["topk(ratio=0.1)", "topk(ratio=0.01)",
                                               "dgc(ratio=0.01)"]
    assert [r["memory"] for r in rows] == ["residual"] * 3  # beta does not vary
    assert [r["k_hat/k"] for r in rows] == [1.0, 0.9, None]
    assert {p.stem for p in report.plots} == {"pareto", "overhead", "speedup", "loss", "quality"}
    assert "| 1_b | topk(ratio=0.01) |" in report.markdown.read_text()


def test_varying_options_outside_the_method_get_a_column(tmp_path):
    fake_run(tmp_path / "0_a", "topk", 0.1, 50.0, 1000.0)
    fake_run(tmp_path / "1_b", "topk", 0.1, 60.0, 1000.0)
    lines = (tmp_path / "1_b" / "metrics.jsonl").read_text().replace('"lr": 0.1', '"lr": 0.2')
    (tmp_path / "1_b" / "metrics.jsonl").write_text(lines)
    rows = write_report(tmp_path, plots=False).table.rows
    assert [r["options"] for r in rows] == ["trainer.lr=0.1", "trainer.lr=0.2"]


def test_labels_name_what_sets_a_run_apart(tmp_path):
    """Plot labels carry the compressor options that differ among its runs and the other
    options only where a run departs from the common value; a nested part's options count
    only among the runs that use that part."""
    fake_run(tmp_path / "0_a", "topk", 0.01, 50.0, 1000.0)
    fake_run(tmp_path / "1_b", "topk", 0.001, 60.0, 100.0)
    fake_run(tmp_path / "2_c", "dgc", 0.01, 70.0, 100.0)
    fake_run(tmp_path / "3_d", "deepreduce", 0.01, 70.0, 100.0)
    fake_run(tmp_path / "4_e", "deepreduce", 0.01, 70.0, 100.0)
    for run, index, lr in (("3_d", '{"_target_": "a.PackedIndex"}', 0.1),
                           ("4_e", '{"_target_": "a.BloomIndex", "fpr": 0.01, "kernel": "auto"}',
                            0.001)):
        path = tmp_path / run / "metrics.jsonl"
        text = path.read_text()
        path.write_text(text.replace('"ratio": 0.01', f'"ratio": 0.01, "index": {index}')
                        .replace('"lr": 0.1', f'"lr": {lr}'))
    runs = load_runs(tmp_path)
    assert plot_labels(runs) == [
        "topk(ratio=0.01)", "topk(ratio=0.001)", "dgc", "deepreduce(index=PackedIndex)",
        "deepreduce(index=BloomIndex, trainer.lr=0.001)"]
    bloom = describe(runs)[4]["compressor"]
    assert bloom == "deepreduce(ratio=0.01, index=BloomIndex, index.fpr=0.01)"  # no kernel


@pytest.mark.parametrize("higher,front", [(True, [1, 0, 3]), (False, [1, 2])])
def test_pareto_front(higher, front):
    # (bytes, metric): 1 is cheapest; 0 costs more and scores higher; 2 costs more, scores
    # lower; 3 costs most and scores highest
    points = [(200.0, 0.8), (100.0, 0.5), (300.0, 0.4), (400.0, 0.9)]
    assert pareto_front(points, higher) == front


@pytest.mark.slow  # W&B's offline mode starts its service process
def test_report_goes_to_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    fake_run(tmp_path / "0_a", "topk", 0.1, 50.0, 1000.0)
    report = write_report(tmp_path)
    log_to_wandb(report, mode="offline", group="sweep")
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline W&B report run"


def test_report_of_an_empty_directory_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no finished run"):
        write_report(tmp_path)


def test_jsonl_logger_replaces_old_metrics_unless_resumed(tmp_path):
    """A second run into the same directory must not mix with the first run's records
    (reports read every line); a run resumed from a checkpoint continues the file."""
    def records():
        return [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]

    JsonlLogger(str(tmp_path), {"run": 1}).log({"type": "step", "step": 1})
    JsonlLogger(str(tmp_path), {"run": 2}).log({"type": "step", "step": 1})
    assert [r.get("config") for r in records()] == [{"run": 2}, None]
    JsonlLogger(str(tmp_path), {"run": 2}, resume={}).log({"type": "step", "step": 2})
    assert [r["type"] for r in records()] == ["config", "step", "config", "step"]
