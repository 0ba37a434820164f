"""Learning-rate sweeps in a comparison (issue 27 item 5): each rate on the first seed, the rate chosen on the
validation split (never the test split), the other seeds at it (the first seed's run reused), the report's sweeps
section, and --resume. The launch is a fake that writes what a run writes (SEED.yaml, results.json)."""

import json
import math
from pathlib import Path

import pytest
import yaml

from zoo.training import compare, compare_report

REPO = Path(__file__).resolve().parents[1]
TASK = "recipes/configs/mqar/llama_cpu.yaml"  # lr 3e-3, a 100-example validation split
GRID = [1.0e-3, 3.0e-3, 1.0e-2]

# (entry, rate, seed) -> (validation accuracy, validation loss, test accuracy); entries absent: the defaults below
SCORES = {
    # validation prefers 3e-3, the test split would prefer 1e-2: the choice must not peek at the test split
    ("linear", 1e-3, 0): (0.40, 1.0, 0.41), ("linear", 3e-3, 0): (0.60, 0.9, 0.55),
    ("linear", 1e-2, 0): (0.50, 1.1, 0.90), ("linear", 3e-3, 1): (0.62, 0.8, 0.57),
    ("linear", 3e-3, 2): (0.64, 0.7, 0.59),
    # the best validation accuracy at the largest rate: at the edge of the grid
    ("edge", 1e-3, 0): (0.30, 1.0, 0.30), ("edge", 3e-3, 0): (0.50, 1.0, 0.50), ("edge", 1e-2, 0): (0.70, 1.0, 0.70),
    # 1e-3 diverged (NaN loss), 1e-2 crashed: 3e-3 is chosen although its accuracy is the lowest number
    ("broken", 1e-3, 0): (0.90, math.nan, 0.90), ("broken", 3e-3, 0): (0.20, 1.0, 0.20),
    # a tie in accuracy: the lower validation loss (1e-2), not the smaller rate
    ("tied", 1e-3, 0): (0.80, 0.5, 0.80), ("tied", 3e-3, 0): (0.70, 0.1, 0.70), ("tied", 1e-2, 0): (0.80, 0.4, 0.80),
}  # fmt: skip
FAILS = {("broken", 1e-2, 0)}


def fake_results(name, rate, seed):
    validation, loss, test = SCORES.get((name, rate, seed), (0.99, 0.01, 0.98))
    return {"metrics": {"eval_accuracy": test, "eval_loss": 0.5},
            "validation_metrics": {"validation_accuracy": validation, "validation_loss": loss},
            "majority_accuracy": 0.02, "guess_accuracy": 0.25, "answers": 2000, "accuracy_by_distance": [],
            "decoding_state_bytes": 1000, "decoding_state_length": 64, "num_processes": 2,
            **dict.fromkeys(compare.SPEED_COLUMNS, 1.0)}  # fmt: skip


@pytest.fixture
def launches(monkeypatch):
    """The fake launch: writes the run config and results.json where the real one does; records each call."""
    calls = []

    def launch(run, launcher, timeout_s, env=None):
        rate = run.config["learning_rate"]
        calls.append((run.name, rate, run.seed))
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir.parent / f"{run.run_dir.name}.yaml").write_text(yaml.safe_dump(run.config, sort_keys=False))
        if (run.name, rate, run.seed) in FAILS:
            return compare.Outcome("failed", "RuntimeError: boom (exit code 1)")
        results = fake_results(run.name, rate, run.seed)
        (run.run_dir / "results.json").write_text(json.dumps(results))
        return compare.Outcome("ok", results=results)

    monkeypatch.setattr(compare, "launch", launch)
    monkeypatch.setattr(compare_report, "write_plots", lambda summary, out: None)  # the charts: not under test here
    monkeypatch.chdir(REPO)
    return calls


def write_config(tmp_path, variants, **top):
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump({"seeds": [0, 1, 2], **top, "variants": variants,
                                    "tasks": [{"name": "mqar", "config": TASK}]}))  # fmt: skip
    return str(path)


def test_planning_sweeps_rates_on_the_first_seed_and_keeps_the_tasks_rate_elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    variants = [{"variant": "sdpa", "learning_rates": None}, {"variant": "linear"},
                {"name": "own", "variant": "linear", "learning_rates": [1e-4, 1e-3]}]  # fmt: skip
    cfg = compare.load_compare_config(write_config(tmp_path, variants, learning_rates=GRID))
    entries = {e.name: e for e in compare.plan_entries(cfg, tmp_path)}
    assert entries["sdpa"].learning_rates is None and entries["linear"].learning_rates == tuple(GRID)
    assert entries["own"].learning_rates == (1e-4, 1e-3)
    runs = compare.plan_runs(cfg, tmp_path)
    plan = [(r.name, r.seed, r.config["learning_rate"], r.run_dir.relative_to(tmp_path / "runs" / "mqar").as_posix())
            for r in runs]  # fmt: skip
    assert plan == [
        ("sdpa", 0, 3e-3, "sdpa/seed0"), ("sdpa", 1, 3e-3, "sdpa/seed1"), ("sdpa", 2, 3e-3, "sdpa/seed2"),
        ("linear", 0, 1e-3, "linear/lr0.001/seed0"), ("linear", 0, 3e-3, "linear/lr0.003/seed0"),
        ("linear", 0, 1e-2, "linear/lr0.01/seed0"),
        ("own", 0, 1e-4, "own/lr0.0001/seed0"), ("own", 0, 1e-3, "own/lr0.001/seed0"),
    ]  # fmt: skip
    # the swept runs evaluate the validation split (the choice reads it); the others do not pay for it
    assert not any(r.config.get("evaluate_validation") for r in runs if r.name == "sdpa")
    assert all(r.config["evaluate_validation"] is True for r in runs if r.name != "sdpa")
    later = entries["linear"].run(2, 3e-3)
    assert later.config["seed"] == 2 and later.run_dir == tmp_path / "runs/mqar/linear/lr0.003/seed2"


@pytest.mark.parametrize("variants, top, message", [
    ([{"variant": "linear", "learning_rate": 1e-3}], {"learning_rates": GRID}, "sets learning_rate and is swept"),
    ([{"variant": "linear", "learning_rates": [1e-3]}], {}, "at least two distinct positive"),
    ([{"variant": "linear"}], {"learning_rates": [1e-3, -1e-3]}, "at least two distinct positive"),
    ([{"variant": "linear", "learning_rates": "1e-3"}], {}, "at least two distinct positive"),
])  # fmt: skip
def test_bad_sweeps_are_refused_before_any_run(tmp_path, monkeypatch, variants, top, message):
    monkeypatch.chdir(REPO)
    cfg = compare.load_compare_config(write_config(tmp_path, variants, **top))
    with pytest.raises(ValueError, match=message):
        compare.plan_runs(cfg, tmp_path)


def test_sweep_chooses_on_validation_reuses_the_first_seed_and_reports_the_sweep(tmp_path, launches):
    variants = [{"variant": "sdpa", "learning_rates": None}, {"variant": "linear"},
                {"name": "edge", "variant": "linear"}, {"name": "broken", "variant": "linear"},
                {"name": "tied", "variant": "linear"}]  # fmt: skip
    out = tmp_path / "out"
    summary = {r["name"]: r for r in compare.compare(write_config(tmp_path, variants, learning_rates=GRID), str(out))}
    linear_calls = [(rate, seed) for name, rate, seed in launches if name == "linear"]
    assert linear_calls == [(1e-3, 0), (3e-3, 0), (1e-2, 0), (3e-3, 1), (3e-3, 2)]  # seed 0 at 3e-3: not rerun
    assert [(rate, seed) for name, rate, seed in launches if name == "sdpa"] == [(3e-3, 0), (3e-3, 1), (3e-3, 2)]
    assert len(launches) == 3 + 5 + 5 + 5 + 5

    linear = summary["linear"]
    assert linear["learning_rate"] == 3e-3 and linear["learning_rate_note"] == "swept"  # not 1e-2, the test's best
    assert linear["seeds"] == 3 and linear["eval_accuracy"] == pytest.approx((0.55 + 0.57 + 0.59) / 3)
    assert summary["edge"]["learning_rate"] == 1e-2
    assert summary["edge"]["learning_rate_note"] == "swept, at the edge of the grid: widen it"
    assert summary["broken"]["learning_rate"] == 3e-3 and summary["broken"]["status"] == "ok"
    assert summary["tied"]["learning_rate"] == 1e-2  # equal accuracy: the lower validation loss
    assert summary["sdpa"]["learning_rate"] == 3e-3 and summary["sdpa"]["learning_rate_note"] == ""

    record = json.loads((out / "results.json").read_text())
    sweeps = {s["name"]: s for s in record["sweeps"]}
    assert set(sweeps) == {"linear", "edge", "broken", "tied"}
    assert [r["status"] for r in sweeps["broken"]["rates"]] == ["diverged", "ok", "failed"]
    assert sweeps["linear"]["chosen"] == 3e-3 and not sweeps["linear"]["edge"] and sweeps["edge"]["edge"]
    runs = [(r["name"], r["learning_rate"], r["seed"], r["sweep"]) for r in record["runs"] if r["name"] == "linear"]
    assert runs == [("linear", 1e-3, 0, "not chosen"), ("linear", 3e-3, 0, "chosen"), ("linear", 1e-2, 0, "not chosen"),
                    ("linear", 3e-3, 1, "chosen"), ("linear", 3e-3, 2, "chosen")]  # fmt: skip

    report = (out / "results.md").read_text()
    section = report[report.index("## Learning-rate sweeps"):]
    linear_part = section[section.index("### mqar / linear (seed 0)"):section.index("### mqar / edge")]
    assert "| **0.003 (chosen)** | 0.6000 | 0.9000 | 0.5500 | ok |" in linear_part
    assert "| 0.01 | 0.5000 | 1.1000 | 0.9000 | ok |" in linear_part and "edge of the grid" not in linear_part
    assert "Chosen rate 0.01 is at the edge of the grid: widen it." in section
    broken = section[section.index("### mqar / broken"):section.index("### mqar / tied")]
    assert "| 0.001 | 0.9000 | nan | 0.9000 | diverged |" in broken
    assert "| 0.01 | – | – | – | failed: RuntimeError: boom (exit code 1) |" in broken
    table_line = next(line for line in report.splitlines() if line.startswith("| linear |"))
    assert "| 0.003 (swept) |" in table_line and "0.570 ± 0.020" in table_line
    csv = (out / "results.csv").read_text().splitlines()
    header = csv[0].split(",")
    assert {"learning_rate", "sweep", "validation_accuracy", "validation_loss"} <= set(header)
    assert sum(1 for line in csv[1:] if line.startswith("mqar,recall,linear,")) == 5


def test_no_rate_chosen_when_every_rate_fails_or_diverges(tmp_path, launches, monkeypatch):
    monkeypatch.setitem(globals(), "FAILS", FAILS | {("dead", 1e-2, 0)})
    diverged = {("dead", rate, 0): (0.9, math.inf, 0.9) for rate in GRID[:2]}
    monkeypatch.setitem(globals(), "SCORES", {**SCORES, **diverged})
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="1 run"):
        compare.main([write_config(tmp_path, [{"name": "dead", "variant": "linear"}], learning_rates=GRID),
                      "--output_dir", str(out)])  # fmt: skip
    assert launches == [("dead", rate, 0) for rate in GRID]  # no seeds 1 and 2: no rate to run them at
    (entry,) = json.loads((out / "results.json").read_text())["summary"]
    assert entry["status"] == "failed" and entry["seeds_ok"] == 0 and entry["eval_accuracy"] is None
    report = (out / "results.md").read_text()
    assert "No rate chosen: every rate failed or diverged." in report
    assert "**dead** (failed): learning-rate sweep: every rate failed or diverged" in report


def test_resume_reuses_finished_runs_with_the_planned_config(tmp_path, launches):
    config = write_config(tmp_path, [{"variant": "sdpa", "learning_rates": None}, {"variant": "linear"}],
                          learning_rates=GRID)  # fmt: skip
    out = tmp_path / "out"
    first = compare.compare(config, str(out))
    assert len(launches) == 3 + 5
    with pytest.raises(FileExistsError, match="--resume"):
        compare.compare(config, str(out))
    launches.clear()
    again = compare.compare(config, str(out), resume=True)
    assert launches == [] and [r["eval_accuracy"] for r in again] == [r["eval_accuracy"] for r in first]
    # an unfinished run (no results.json) and a run of another config are launched again, the rest reused
    (out / "runs/mqar/linear/lr0.01/seed0/results.json").unlink()
    sdpa_config = out / "runs/mqar/sdpa/seed1.yaml"
    sdpa_config.write_text(sdpa_config.read_text().replace("max_steps: 600", "max_steps: 400"))
    compare.compare(config, str(out), resume=True)
    assert launches == [("sdpa", 3e-3, 1), ("linear", 1e-2, 0)]
    compare.main([config, "--output_dir", str(out), "--resume"])
    assert launches == [("sdpa", 3e-3, 1), ("linear", 1e-2, 0)]
    with pytest.raises(SystemExit):
        compare.main([config, "--output_dir", str(out), "--resume", "--overwrite"])


def test_resume_reuses_the_runs_of_a_comparison_moved_to_another_folder(tmp_path, launches):
    """A comparison's folder moved (docs/recall/... to results/recall/...) resumes there: a run's saved config
    differs from the planned one only in output_dir, the folder's own path."""
    config = write_config(tmp_path, [{"variant": "sdpa", "learning_rates": None}], learning_rates=GRID)
    first = compare.compare(config, str(tmp_path / "docs" / "out"))
    (tmp_path / "results").mkdir()
    (tmp_path / "docs" / "out").rename(tmp_path / "results" / "out")
    launches.clear()
    again = compare.compare(config, str(tmp_path / "results" / "out"), resume=True)
    assert launches == [] and [r["eval_accuracy"] for r in again] == [r["eval_accuracy"] for r in first]
    assert all(r["run_dir"].startswith("runs/") for r in compare_report_rows(tmp_path / "results" / "out"))


def compare_report_rows(out):
    return json.loads((out / "results.json").read_text())["runs"]


def test_sweep_ties_fall_to_the_smaller_rate_and_perplexity_is_lower_is_better(tmp_path):
    entry = compare.Entry("t", "e", {}, [0], "recall", tmp_path, (1e-3, 3e-3))
    same = compare.Outcome("ok", results={"validation_metrics": {"validation_accuracy": 0.5, "validation_loss": 1.0}})
    assert compare.sweep_record(entry, {1e-3: same, 3e-3: same})["chosen"] == 1e-3
    assert compare.sweep_record(entry, {3e-3: same})["chosen"] is None  # 1e-3 has not run yet
    lm = compare.Entry("t", "e", {}, [0], "lm", tmp_path, (1e-3, 3e-3))
    low, high = ({"validation_metrics": {"validation_perplexity": p, "validation_loss": 1.0}} for p in (5.0, 9.0))
    record = compare.sweep_record(lm, {1e-3: compare.Outcome("ok", results=high),
                                       3e-3: compare.Outcome("ok", results=low)})  # fmt: skip
    assert record["metric"] == "validation_perplexity" and record["chosen"] == 3e-3 and record["edge"]
    missing = compare.sweep_record(entry, {1e-3: compare.Outcome("ok", results={}), 3e-3: same})
    assert [r["status"] for r in missing["rates"]] == ["no validation metric", "ok"] and missing["chosen"] == 3e-3


def test_finetune_evaluates_the_validation_split_with_its_own_metrics(tmp_path, monkeypatch):
    """The tiny MQAR fine-tune (one process, 2 steps) with evaluate_validation: results.json's validation_metrics
    come from the validation split (8 examples, 2 answers each), the test metrics from the test split (16)."""
    from zoo.training import finetune
    from zoo.training.config import parse_config

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("ATTENTION_ZOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    smoke = yaml.safe_load((REPO / "recipes/configs/compare_recall_smoke.yaml").read_text())["overrides"]
    args = [TASK, "--output_dir", str(tmp_path / "run"), "--evaluate_validation", "true"]
    for key, value in smoke.items():
        args += [f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value)]
    results = finetune.run(parse_config(args))
    validation = results["validation_metrics"]
    assert validation["validation_answers"] == 8 * 2 and results["answers"] == 16 * 2
    assert 0 <= validation["validation_accuracy"] <= 1 and math.isfinite(validation["validation_loss"])
    assert results["metrics"]["eval_accuracy"] == pytest.approx(
        sum(b["accuracy"] * b["answers"] for b in results["accuracy_by_distance"] if b["answers"]) / 32)
