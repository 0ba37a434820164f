"""The recall comparison end to end (recipes/configs/compare_recall_smoke.yaml): each entry trains on MQAR, the report
gives accuracy by distance, decoding state bytes, the frontier plots and says what cannot be trusted."""

import json
import re
from pathlib import Path

import pytest

from zoo.training import compare

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_recall_comparison_reports_state_bytes_distance_and_trust(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("ATTENTION_ZOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "compare"
    summary = {row["name"]: row for row in compare.compare("recipes/configs/compare_recall_smoke.yaml", str(out))}
    assert all(row["status"] == "ok" for row in summary.values()), {n: r["error"] for n, r in summary.items()}
    state = {name: row["decoding_state_bytes"] for name, row in summary.items()}
    # 16-token sequences, 2 layers, width 16 (fp32 keys and values): sdpa holds every key, the window 2 keys per
    # layer, the hybrid the window's key and linear attention's 2 x 8 x 9 state
    assert state["sdpa"] == 2 * 2 * 16 * 16 * 4
    assert state["window-4"] < state["hybrid"] < state["sdpa"]
    buckets = summary["sdpa"]["accuracy_by_distance"]
    assert [b["bucket"] for b in buckets][:2] == ["[1,2)", "[2,4)"] and sum(b["answers"] for b in buckets) == 32
    curve = summary["sdpa"]["training_loss"]  # from the run's train_log.jsonl: the report's training curves
    assert len(curve) >= 2 and [step for step, _ in curve] == sorted({step for step, _ in curve})
    for name in ("results.md", "results.csv", "frontier_mqar.png", "accuracy_by_distance_mqar.png",
                 "training_loss_mqar.png"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "results.md").read_text()
    assert "(1 seed)" in report and not re.search(r"\d ± \d", report)  # one seed: no spread shown
    assert "1 seed: no spread" in report and "Accuracy by query-key distance" in report
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert all(run["decoding_state_bytes"] for run in runs)


def test_training_curves_average_the_seeds_at_the_steps_all_of_them_logged(tmp_path):
    for seed, lines in enumerate([[(10, 2.0), (20, 1.0)], [(10, 4.0), (20, 3.0), (30, 0.5)]]):
        run_dir = tmp_path / f"seed{seed}"
        run_dir.mkdir()
        records = [{"step": step, "loss": loss} for step, loss in lines] + [{"step": 30, "eval_loss": 9.0}]
        (run_dir / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    curves = [compare.training_loss(tmp_path / f"seed{seed}") for seed in range(2)]
    assert curves[0] == [(10, 2.0), (20, 1.0)]  # eval records carry no training loss
    assert compare.mean_training_loss(curves) == [(10, 3.0), (20, 2.0)]
    assert compare.training_loss(tmp_path / "missing") == [] and compare.mean_training_loss([[], []]) == []
