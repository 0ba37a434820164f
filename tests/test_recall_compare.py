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


# ---------------------------------------------------------------------------------------------------
# claims from numbers (issue 29, item 4): receptive field, within / beyond it, Welch's t, stalled seeds


def _seed_row(name, variant, params, seed, accuracy, buckets):
    return {"task": "mqar", "kind": "recall", "name": name, "variant": variant, "variant_params": params,
            "max_length": 64, "num_layers": 2, "seed": seed, "status": "ok", "error": None, "eval_accuracy": accuracy,
            "eval_loss": 0.1, "accuracy_by_distance": [
                {"bucket": f"[{s},{2 * s})", "start": s, "end": 2 * s, "answers": 100, "accuracy": a}
                for s, a in zip((4, 8, 16, 32), buckets, strict=True)], "loss_by_position": None,
            "training_loss": [], "decoding_state_bytes": 1, "majority_accuracy": 0.02, "guess_accuracy": 0.25,
            "answers": 400, **dict.fromkeys(compare.METRIC_COLUMNS[1:2] + compare.METRIC_COLUMNS[3:]),
            **dict.fromkeys(compare.SPEED_COLUMNS, 1.0)}  # fmt: skip


def test_receptive_fields_add_up_over_stacked_layers():
    from zoo.training.recall import receptive_field

    assert receptive_field("longformer", {"window": 32}, 2) == 32  # 16 back per layer, two layers
    assert receptive_field("xformers", {"window": 8}, 3) == 21
    assert receptive_field("sdpa", {}, 2) is None and receptive_field("linear", {}, 2) is None
    hybrid = {"layers": [{"variant": "longformer", "params": {"window": 16}}, {"variant": "sdpa"}]}
    assert receptive_field("hybrid", hybrid, 2) is None
    windows = {"layers": [{"variant": "longformer", "params": {"window": 16}}, {"variant": "xformers",
                                                                               "params": {"window": 4}}]}
    assert receptive_field("hybrid", windows, 2) == 8 + 3


def test_welch_t_test_matches_scipy_and_stalled_seeds_are_named():
    from zoo.training.recall import stalled_seeds, welch

    scipy_stats = pytest.importorskip("scipy.stats")
    a, b = [0.989, 0.999, 0.9945], [0.937, 0.9915, 0.993]
    t, _, p = welch(a, b)
    want = scipy_stats.ttest_ind(a, b, equal_var=False)
    assert abs(t - want.statistic) < 1e-9 and abs(p - want.pvalue) < 1e-6
    assert stalled_seeds(list(enumerate(b))) == [(0, 0.937)]
    assert welch([0.99, 1.0, 0.995], [1.0, 0.99, 0.995])[2] == 1.0  # equal means: t = 0, p = 1 (was a math error)
    assert stalled_seeds(list(enumerate(a))) == []


def test_the_report_splits_accuracy_at_the_receptive_field_and_tests_with_welch():
    rows = [_seed_row("sdpa", "sdpa", {}, s, acc, [acc] * 4) for s, acc in enumerate((0.989, 0.999, 0.9945))]
    rows += [_seed_row("window-32", "longformer", {"window": 32}, s, acc, [0.8, 0.85, 0.4, 0.03])
             for s, acc in enumerate((0.52, 0.55, 0.58))]
    rows += [_seed_row("hybrid", "hybrid", {"layers": [{"variant": "longformer", "params": {"window": 16}},
                                                      {"variant": "sdpa"}]}, s, acc, [acc] * 4)
             for s, acc in enumerate((0.937, 0.9915, 0.993))]
    report = "\n".join(compare.KINDS["recall"].tables(compare.summarize(rows)))
    window = next(line for line in report.splitlines() if line.startswith("| window-32"))
    assert "32 (2 layers)" in window and "0.683 (n=300) / 0.030 (n=100)" in window
    assert "below the best (sdpa): Welch's t = " in window
    hybrid = next(line for line in report.splitlines() if line.startswith("| hybrid"))
    assert "unbounded" in hybrid and "seed 0 stalls (0.937 against 0.992–0.993 of the others)" in hybrid
    assert "inside the seeds' spread" not in report and "Welch's t (two-sided" in report
