"""Compare attention variants: the same fine-tune (data, seed, budget) once per variant, each its own run.

``python recipes/compare.py CONFIG.yaml [--output_dir DIR] [--overwrite | --resume]``. Each run is a separate
``accelerate launch`` (or plain python with ``launcher: null``), so a variant that crashes, runs out of memory or is not
installed is recorded in the table while the others go on; the command exits non-zero when any run failed or timed
out (after writing the report). Writes ``results.md`` / ``.csv`` / ``.json`` and per-task charts.

Learning-rate sweeps: an entry's ``learning_rates: [1e-3, 3e-3, 1e-2]`` (or the compare config's top-level
``learning_rates``, the default of every entry that does not name its own; ``learning_rates: null`` on an entry keeps
the task's rate) trains each rate on the first seed, keeps the rate with the best validation metric (the task's
validation split, never its test split; ties: the lower validation loss, then the smaller rate), then runs the other
seeds at it (the first seed's run at that rate is reused). ``--resume`` reuses every run folder of the output folder
whose results.json exists and whose run config equals the planned one.

Outputs, charts and config keys: docs/notes/training.md#compare
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from zoo.data import get_task
from zoo.registry import get_variant_class
from zoo.reporting import fixed, markdown_table, pyplot, save_figure, write_csv
from zoo.training.config import FinetuneConfig, check_known_keys, load_yaml
from zoo.training.kinds import KINDS
from zoo.training.results import package_versions

COMPARE_KEYS = ("output_dir", "launcher", "seeds", "timeout_minutes", "overrides", "learning_rates", "variants",
                "tasks")
TASK_KEYS = ("name", "config", "overrides", "variants", "seeds")
METRIC_COLUMNS = ("eval_accuracy", "eval_macro_f1", "eval_loss", "eval_perplexity")
SPEED_COLUMNS = (
    "train_tokens_per_second", "eval_tokens_per_second", "decode_tokens_per_second", "peak_memory_mb",
    "wall_time_seconds",
)  # fmt: skip
FAILED = ("failed", "timeout")  # statuses that make the command exit non-zero (after writing the report)


@dataclass
class Run:
    task: str
    name: str
    seed: int
    config: dict
    run_dir: Path
    kind: str = "classification"  # the task's kind, a key of zoo.training.kinds.KINDS
    learning_rates: tuple[float, ...] | None = None  # the entry's sweep grid (None: no sweep, the task's rate)


@dataclass
class Entry:
    """One (task, variant entry): its merged fine-tune config (no seed, no output_dir), seeds and sweep grid."""

    task: str
    name: str
    config: dict
    seeds: list[int]
    kind: str
    folder: Path  # output_dir/runs/TASK/NAME
    learning_rates: tuple[float, ...] | None = None

    def run(self, seed: int, rate: float | None = None) -> Run:
        """The run of one seed (at one rate of the sweep: its own folder, NAME/lr0.003/seed0)."""
        folder = self.folder if rate is None else self.folder / f"lr{rate:g}"
        run_dir = folder / f"seed{seed}"
        config = {**self.config, "seed": seed, "output_dir": str(run_dir), "overwrite_output_dir": True}
        if rate is not None:
            config["learning_rate"] = rate
        return Run(self.task, self.name, seed, config, run_dir, self.kind, self.learning_rates)

    def first_runs(self) -> list[Run]:
        """What runs before any result is known: every seed, or (a sweep) every rate on the first seed."""
        if self.learning_rates is None:
            return [self.run(seed) for seed in self.seeds]
        return [self.run(self.seeds[0], rate) for rate in self.learning_rates]


@dataclass
class Outcome:
    status: str  # ok | failed | timeout | unavailable
    error: str = ""
    results: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------
# plan


def load_compare_config(path: str) -> dict:
    cfg = load_yaml(path)
    unknown = sorted(set(cfg) - set(COMPARE_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; compare configs take {', '.join(COMPARE_KEYS)}.")
    if not cfg.get("tasks"):
        raise ValueError(f"{path}: list at least one task under `tasks:` (name + config).")
    cfg.setdefault("seeds", [42])
    cfg.setdefault("launcher", None)
    cfg.setdefault("timeout_minutes", 60)
    if cfg["launcher"] and not Path(cfg["launcher"]).is_file():
        raise FileNotFoundError(f"launcher {cfg['launcher']!r} (an accelerate config file) does not exist.")
    return cfg


def variant_label(entry: dict) -> str:
    return entry.get("name") or entry.get("variant", "sdpa")


def sweep_grid(value: Any, source: str) -> tuple[float, ...] | None:
    """A ``learning_rates`` value checked: None, or at least two distinct positive numbers."""
    if value is None:
        return None
    numbers = isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    if not numbers or len(set(value)) < 2 or len(set(value)) != len(value) or min(value) <= 0:
        raise ValueError(f"{source}: learning_rates must be a list of at least two distinct positive rates, e.g. "
                         f"[1.0e-3, 3.0e-3, 1.0e-2], or null (the task's rate); got {value!r}.")
    return tuple(float(v) for v in value)


def plan_entries(cfg: dict, output_dir: Path) -> list[Entry]:
    """Every (task, variant entry) with its full fine-tune config and sweep grid, checked before anything starts."""
    entries_out = []
    default_grid = sweep_grid(cfg.get("learning_rates"), "compare config")
    for task in cfg["tasks"]:
        unknown = sorted(set(task) - set(TASK_KEYS))
        if unknown or "name" not in task or "config" not in task:
            raise ValueError(
                f"task entry {task!r}: needs `name` and `config`; optional keys: overrides, variants, seeds."
            )
        base = load_yaml(task["config"])
        entries = list(cfg.get("variants") or []) + list(task.get("variants") or [])
        labels = [variant_label(e) for e in entries]
        if len(set(labels)) != len(labels):
            raise ValueError(f"task {task['name']!r}: two variant entries share a name; give each a distinct `name`.")
        for entry in entries:
            source = f"task {task['name']!r}, variant {variant_label(entry)!r}"
            overrides = {k: v for k, v in entry.items() if k not in ("name", "learning_rates")}
            merged = {**base, **(cfg.get("overrides") or {}), **(task.get("overrides") or {}), **overrides}
            check_known_keys(merged, FinetuneConfig, source)
            grid = sweep_grid(entry["learning_rates"], source) if "learning_rates" in entry else default_grid
            if grid is not None and "learning_rate" in entry:
                raise ValueError(f"{source}: sets learning_rate and is swept over learning_rates; keep one (an "
                                 "entry with its own rate takes learning_rates: null).")
            if grid is not None:
                merged["evaluate_validation"] = True  # the rate is chosen on the validation split
            seeds = list(task.get("seeds") or cfg["seeds"])  # a task may set its own seeds
            folder = output_dir / "runs" / task["name"] / variant_label(entry)
            kind = get_task(merged.get("task", "")).kind
            entries_out.append(Entry(task["name"], variant_label(entry), merged, seeds, kind, folder, grid))
    return entries_out


def plan_runs(cfg: dict, output_dir: Path) -> list[Run]:
    """The runs known before any has run: every seed of each entry; a sweep's rates on its first seed (the other
    seeds run at the rate its results choose, :func:`choose_rate`)."""
    return [run for entry in plan_entries(cfg, output_dir) for run in entry.first_runs()]


# ---------------------------------------------------------------------------------------------------
# launch


def command_for(run_config: Path, launcher: str | None) -> list[str]:
    if launcher:
        accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", launcher, "-m"]
        return [*accelerate, "zoo.training.finetune", str(run_config)]
    return [sys.executable, "-m", "zoo.training.finetune", str(run_config)]


def unavailable_reason(variant: str) -> str | None:
    """Why a variant cannot run here (not installed, broken plugin), or None. Checked without launching."""

    try:
        get_variant_class(variant)
    except Exception as exc:  # UnknownVariantError, BrokenVariantError, VariantConflictError
        return f"{type(exc).__name__}: {exc}"
    return None


def launch(run: Run, launcher: str | None, timeout_s: float) -> Outcome:
    reason = unavailable_reason(run.config.get("variant", "sdpa"))
    if reason:
        return Outcome("unavailable", reason)
    if run.run_dir.exists():
        shutil.rmtree(run.run_dir)
    run.run_dir.mkdir(parents=True)
    run_config = run.run_dir.parent / f"{run.run_dir.name}.yaml"
    run_config.write_text(yaml.safe_dump(run.config, sort_keys=False))
    log_path = run.run_dir.parent / f"{run.run_dir.name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command_for(run_config, launcher), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)  # the launcher and the training processes it started
            process.wait()
            return Outcome("timeout", f"stopped after {timeout_s / 60:.0f} minutes (timeout_minutes); log: {log_path}")
    results_path = run.run_dir / "results.json"  # the run folder was emptied above: this run wrote it
    if not results_path.is_file():
        return Outcome("failed", f"{last_error(log_path)} (exit code {returncode}; log: {log_path})")
    note = "" if returncode == 0 else f"exit code {returncode} after writing its results: {last_error(log_path)}"
    return Outcome("ok", note, results=json.loads(results_path.read_text()))


ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt))\b:?(.*)$")
WRAPPER_ERRORS = ("ChildFailedError", "CalledProcessError")
CRASH_LINE = re.compile(r"(Signal \d+ \(\w+\) received by PID \d+|terminate called .*|Killed|Segmentation fault.*)")
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?(.*)$")  # torchrun prefixes each worker's output lines
ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")


def last_error(log_path: Path) -> str:
    """The failing process's exception (``SomethingError: message``), else a crash line, else the log's last line.

    Under a launcher, the exception of the rank torchrun names as the root cause (or of the rank that raised first):
    the other ranks then fail only because they were stopped (``Signal 15 (SIGTERM)``) or lost their peer.
    """
    lines = log_path.read_text(errors="replace").splitlines()
    errors = []  # (rank or None, line) of every exception line, in log order
    for line in lines:
        match = RANK_PREFIX.match(line.strip())
        rank, text = (int(match.group(1)), match.group(2).strip()) if match else (None, line.strip())
        error = ERROR_LINE.match(text)
        if error and error.group(1) not in WRAPPER_ERRORS:
            errors.append((rank, text))
    if errors:
        rank = root_cause_rank(lines)
        if rank is None or all(r != rank for r, _ in errors):
            rank = errors[0][0]  # the first to raise
        text = [t for r, t in errors if r == rank][-1]
        return (text if rank is None else f"rank {rank}: {text}")[:500]
    for line in reversed(lines):
        crash = CRASH_LINE.search(line)
        if crash:
            return crash.group(1)[:500]
    tail = [line.strip() for line in lines if line.strip()]
    return tail[-1][:500] if tail else "no output"


def root_cause_rank(lines: list[str]) -> int | None:
    """The rank under torchrun's "Root Cause (first observed failure)" heading, if the log has one."""
    for i, line in enumerate(lines):
        if line.startswith("Root Cause"):
            for follow in lines[i + 1 : i + 8]:
                match = ROOT_CAUSE_RANK.match(follow)
                if match:
                    return int(match.group(1))
    return None


def reusable(run: Run) -> Outcome | None:
    """``--resume``: the outcome of a run folder that finished (results.json) with the planned config (the run's
    SEED.yaml beside it equals ``run.config``), else None (the run is launched again)."""
    results_path, run_config = run.run_dir / "results.json", run.run_dir.parent / f"{run.run_dir.name}.yaml"
    if not (results_path.is_file() and run_config.is_file()):
        return None
    try:
        if yaml.safe_load(run_config.read_text()) != run.config:
            return None
        return Outcome("ok", results=json.loads(results_path.read_text()))
    except (ValueError, yaml.YAMLError):
        return None


# ---------------------------------------------------------------------------------------------------
# learning-rate sweeps


def validation_key(kind: str) -> tuple[str, bool]:
    """The validation metric a sweep chooses on (the kind's headline metric on the validation split) and whether
    lower is better (perplexity, loss)."""
    key = "validation_" + KINDS[kind].headline[0].removeprefix("eval_")
    return key, key.endswith(("perplexity", "loss"))


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def sweep_record(entry: Entry, outcomes: dict[float, Outcome]) -> dict:
    """One entry's sweep on its first seed: each rate's validation metric and loss, its evaluation-split (test)
    metric and status (``diverged``: a non-finite validation metric or loss; ``no validation metric``: results.json
    lacks it), and the chosen rate: the best validation metric among the ``ok`` rates, ties to the lower validation
    loss, then the smaller rate. None while a rate has not run, or when none is ``ok``."""
    key, lower = validation_key(entry.kind)
    test_key = KINDS[entry.kind].headline[0]
    rates = []
    for rate in entry.learning_rates:
        outcome = outcomes.get(rate)
        if outcome is None:
            rates.append({"learning_rate": rate, "status": "pending", key: None, "validation_loss": None,
                          test_key: None, "error": ""})  # fmt: skip
            continue
        validation = outcome.results.get("validation_metrics") or {}
        value, loss = validation.get(key), validation.get("validation_loss")
        status = outcome.status
        if status == "ok" and value is None:
            status = "no validation metric"
        elif status == "ok" and not (finite(value) and (loss is None or finite(loss))):
            status = "diverged"
        rates.append({"learning_rate": rate, "status": status, key: value, "validation_loss": loss,
                      test_key: outcome.results.get("metrics", {}).get(test_key), "error": outcome.error})
    chosen = None
    candidates = [r for r in rates if r["status"] == "ok"]
    if candidates and all(r["status"] != "pending" for r in rates):
        best = min(candidates, key=lambda r: (r[key] if lower else -r[key],
                                              r["validation_loss"] if finite(r["validation_loss"]) else math.inf,
                                              r["learning_rate"]))  # fmt: skip
        chosen = best["learning_rate"]
    grid = entry.learning_rates
    return {"task": entry.task, "name": entry.name, "seed": entry.seeds[0], "metric": key, "test_metric": test_key,
            "lower_is_better": lower, "eval_split": entry.config.get("eval_split", "test"), "rates": rates,
            "chosen": chosen, "edge": chosen is not None and chosen in (min(grid), max(grid))}  # fmt: skip


EDGE_NOTE = "at the edge of the grid: widen it"


def sweep_lines(sweeps: list[dict]) -> list[str]:
    """The report's "Learning-rate sweeps" section: per entry each rate's validation metric, validation loss and
    test metric on the sweep seed, the chosen rate in bold, failed and diverged runs named, an edge note."""
    if not sweeps:
        return []
    lines = ["", "## Learning-rate sweeps", "",
             "Each swept entry trained every rate of its grid on its first seed; the rate with the best validation "
             "metric (the task's validation split, never the test split) was kept, ties to the lower validation "
             "loss, then the smaller rate; the other seeds ran at it (the sweep seed's run is reused as that seed). "
             "A rate at the edge of the grid may not be the best one."]  # fmt: skip
    for sweep in sweeps:
        key, test_key = sweep["metric"], sweep["test_metric"]
        lines += ["", f"### {sweep['task']} / {sweep['name']} (seed {sweep['seed']})", ""]
        table = []
        for r in sweep["rates"]:
            rate = f"{r['learning_rate']:g}"
            rate = f"**{rate} (chosen)**" if r["learning_rate"] == sweep["chosen"] else rate
            status = r["status"] + (f": {r['error'][:200]}" if r["error"] and r["status"] != "ok" else "")
            table.append([rate, fixed(r[key], 4), fixed(r["validation_loss"], 4), fixed(r[test_key], 4), status])
        header = ["learning rate", key.replace("_", " "), "validation loss",
                  f"{sweep['eval_split']} {test_key.removeprefix('eval_').replace('_', ' ')}", "status"]
        lines += markdown_table(header, table, align="lrrrl")
        if sweep["chosen"] is None:
            done = all(r["status"] != "pending" for r in sweep["rates"])
            lines += ["", "No rate chosen: every rate failed or diverged." if done else "No rate chosen yet."]
        elif sweep["edge"]:
            lines += ["", f"Chosen rate {sweep['chosen']:g} is {EDGE_NOTE}."]
    return lines


# ---------------------------------------------------------------------------------------------------
# report


def row_for(run: Run, outcome: Outcome) -> dict[str, Any]:
    results = outcome.results
    row = {
        "task": run.task,
        "kind": run.kind,
        "name": run.name,
        "variant": run.config.get("variant", "sdpa"),
        "variant_params": run.config.get("variant_params") or {},
        "max_length": run.config.get("max_length"),
        "num_layers": (run.config.get("model_config") or {}).get("num_hidden_layers"),
        "seed": run.seed,
        "learning_rate": run.config.get("learning_rate"),
        "sweep": "" if run.learning_rates is None else "pending",  # chosen | not chosen | no rate chosen, once known
        "status": outcome.status,
        "error": outcome.error,
    }
    row.update({key: results.get("metrics", {}).get(key) for key in METRIC_COLUMNS})
    validation = results.get("validation_metrics") or {}
    row.update({f"validation_{key.removeprefix('eval_')}": validation.get(f"validation_{key.removeprefix('eval_')}")
                for key in METRIC_COLUMNS})  # fmt: skip
    row.update({key: results.get(key) for key in SPEED_COLUMNS})
    row["loss_by_position"] = results.get("loss_by_position")
    row["training_loss"] = training_loss(run.run_dir)
    row.update({key: results.get(key) for key in KINDS[run.kind].result_columns})
    row.update({"num_processes": results.get("num_processes"), "run_dir": str(run.run_dir)})
    return row


def summarize(rows: list[dict], sweeps: list[dict] | None = None) -> list[dict]:
    """One row per (task, name): means over the seeds that finished, standard deviations of the metrics. A swept
    entry's row holds its runs at the chosen rate (its ``learning_rate``; ``learning_rate_note``: swept, at the edge
    of the grid); the other rates are in ``sweeps`` only."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("sweep") not in ("pending", "not chosen"):
            groups.setdefault((row["task"], row["name"]), []).append(row)
    edges = {(s["task"], s["name"]): s["edge"] for s in sweeps or []}
    summary = []
    for group in groups.values():
        unchosen = all(r.get("sweep") == "no rate chosen" for r in group)  # every swept rate failed or diverged
        done = [] if unchosen else [r for r in group if r["status"] == "ok"]
        first = group[0]
        entry = {k: first[k] for k in ("task", "kind", "name", "variant", "variant_params", "max_length")}
        entry["seeds_ok"], entry["seeds"] = len(done), len(group)
        entry["learning_rate"] = first.get("learning_rate")
        swept = first.get("sweep") == "chosen"
        edge = edges.get((first["task"], first["name"]))
        entry["learning_rate_note"] = ("swept, " + EDGE_NOTE if edge else "swept") if swept else ""
        failed = next((r for r in group if r["status"] != "ok"), None)
        entry["status"] = "ok" if failed is None else failed["status"]
        notes = dict.fromkeys(r["error"] for r in group if r["error"])
        entry["error"] = failed["error"] if failed else "; ".join(notes)
        if unchosen:
            entry["status"] = "failed"
            entry["error"] = "learning-rate sweep: every rate failed or diverged (see Learning-rate sweeps)"
        for key in METRIC_COLUMNS + SPEED_COLUMNS:
            values = [r[key] for r in done if r[key] is not None]
            entry[key] = statistics.fmean(values) if values else None
            if key in METRIC_COLUMNS:
                entry[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0 if values else None
        entry["loss_by_position"] = mean_loss_by_position([r["loss_by_position"] for r in done])
        entry["training_loss"] = mean_training_loss([r["training_loss"] for r in done])
        summary_fields = KINDS[first["kind"]].summary_fields
        if summary_fields is not None:
            entry.update(summary_fields(done))
        summary.append(entry)
    return summary


def mean_loss_by_position(runs: list[list[dict]]) -> list[dict] | None:
    """Bucket-wise mean of the seeds' loss-by-position lists (same max_length, so the same buckets)."""
    runs = [buckets for buckets in runs if buckets]
    if not runs:
        return None
    merged = []
    for buckets in zip(*runs, strict=True):
        losses = [b["loss"] for b in buckets if b["loss"] is not None]
        merged.append({**buckets[0], "loss": statistics.fmean(losses) if losses else None})
    return merged


def training_loss(run_dir: Path) -> list[tuple[int, float]]:
    """(step, training loss) at each logging step, from the run's ``train_log.jsonl`` (:class:`~.results.JsonlLog`;
    empty when the run logged none). The curve says whether a run that scores at chance was still learning."""
    log = Path(run_dir) / "train_log.jsonl"
    if not log.is_file():
        return []
    records = (json.loads(line) for line in log.read_text().splitlines() if line.strip())
    return [(r["step"], float(r["loss"])) for r in records if "loss" in r and "step" in r]


def mean_training_loss(runs: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """The seeds' mean training loss at the steps every seed logged."""
    runs = [dict(curve) for curve in runs if curve]
    if not runs:
        return []
    steps = sorted(set.intersection(*(set(curve) for curve in runs)))
    return [(step, statistics.fmean(curve[step] for curve in runs)) for step in steps]


def markdown_report(cfg: dict, summary: list[dict], config_path: str, minutes: float,
                    sweeps: list[dict] | None = None) -> str:
    packages = ", ".join(f"{k} {v}" for k, v in package_versions().items())
    seeds = {task["name"]: task.get("seeds") or cfg["seeds"] for task in cfg["tasks"]}  # a task may set its own
    seeds_text = ", ".join(f"{name} {value}" for name, value in seeds.items())
    lines = [
        "# attention-zoo comparison",
        "",
        f"Config `{config_path}`; launcher `{cfg['launcher'] or 'python (1 process)'}`; seeds: {seeds_text}; "
        f"{minutes:.1f} minutes in all. Packages: {packages}.",
        "Metrics on each task's evaluation split (mean ± std over seeds); train tokens/s counts non-padding tokens "
        "over all processes; peak memory is the largest process's (CPU: max RSS; GPU: peak allocation).",
    ]
    for task in dict.fromkeys(r["task"] for r in summary):
        rows = [r for r in summary if r["task"] == task]
        lines += ["", f"## {task}", ""]
        kind = KINDS[rows[0]["kind"]]
        lines += kind.tables(rows)
        notes = [r for r in rows if r["error"]]
        if notes:
            lines += ["", "Failures and notes:", ""]
            lines += [f"- **{r['name']}** ({r['status']}): {r['error']}" for r in notes]
        label = kind.headline[1]
        lines += ["", f"![LRA-style chart]({plot_name('lra', task)})", f"![{label}]({plot_name(label, task)})"]
        if any(r["training_loss"] for r in rows):
            lines.append(f"![training loss]({plot_name('training_loss', task)})")
        lines += [f"![{alt}]({plot_name(name, task)})" for alt, name in kind.images]
    lines += sweep_lines(sweeps or [])
    return "\n".join(lines) + "\n"


def plot_name(kind: str, task: str) -> str:
    return f"{kind}_{task}.png"


def write_plots(summary: list[dict], out: Path) -> None:
    plt = pyplot()
    for task in dict.fromkeys(r["task"] for r in summary):
        rows = [r for r in summary if r["task"] == task]
        kind = KINDS[rows[0]["kind"]]
        metric, label = kind.headline
        done = [r for r in rows if r[metric] is not None]
        fig, ax = plt.subplots(figsize=(8, 5))
        if done:
            bubble_chart(ax, done, metric)
        title = f"{task}: {label} vs speed (area: peak memory per process)"
        ax.set(xlabel="training tokens / second", ylabel=label, title=title)
        save_figure(fig, out / plot_name("lra", task))

        fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows) + 2), 4))
        names = [r["name"] for r in rows]
        values = [r[metric] or 0.0 for r in rows]
        errors = [r[f"{metric}_std"] or 0.0 for r in rows]
        colors = ["tab:blue" if r["status"] == "ok" else "lightgray" for r in rows]
        ax.bar(names, values, yerr=errors if any(errors) else None, capsize=4, color=colors)
        for i, r in enumerate(rows):
            if r["status"] != "ok":
                ax.text(i, 0.01, r["status"], ha="center", va="bottom", rotation=90, fontsize=8)
        ax.set(ylabel=label, title=f"{task}: {label} per variant")
        ax.tick_params(axis="x", rotation=30)
        save_figure(fig, out / plot_name(label, task))
        if any(r["training_loss"] for r in rows):
            plot_training_loss(plt, task, rows, out)
        for name, plot in kind.plots:
            plot(plt, task, rows, out / plot_name(name, task))


def bubble_chart(ax, rows: list[dict], metric: str) -> None:
    """The LRA paper's chart: quality against speed, bubble area = peak memory. Entries are told apart by colour in
    a legend (names written at the bubbles overlap when entries score alike), a second legend maps areas to MB, and
    the axes leave room for the largest bubble."""
    memory = [r["peak_memory_mb"] or 1.0 for r in rows]
    scale = 1500 / max(memory)
    for index, (r, mb) in enumerate(zip(rows, memory, strict=True)):
        ax.scatter(r["train_tokens_per_second"], r[metric], s=mb * scale, alpha=0.5, color=f"C{index % 10}",
                   edgecolors="black", linewidths=0.5, label=r["name"])
    names = ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, title="entry", markerscale=0.3)
    ax.add_artist(names)
    reference = sorted({round(max(memory) * f, -1) or 1.0 for f in (0.25, 0.5, 1.0)})
    handles = [ax.scatter([], [], s=mb * scale, color="lightgray", edgecolors="black") for mb in reference]
    ax.legend(handles, [f"{mb:,.0f} MB" for mb in reference], loc="lower left", bbox_to_anchor=(1.02, 0.0),
              fontsize=8, title="peak memory", labelspacing=2.2, borderpad=1.5, handletextpad=2.0, frameon=False)
    ax.margins(x=0.2, y=0.2)


def plot_training_loss(plt, task: str, rows: list[dict], out: Path) -> None:
    """Training loss against step, one line per entry (mean over its seeds)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r["training_loss"]:
            steps, losses = zip(*r["training_loss"], strict=True)
            ax.plot(steps, losses, marker=".", label=r["name"])
    ax.set(xlabel="optimizer step", ylabel="training loss (nats, mean over seeds)", title=f"{task}: training loss")
    ax.legend(fontsize=8)
    save_figure(fig, out / plot_name("training_loss", task))


def csv_row(row: dict) -> dict:
    """Nested values as JSON text: variant_params, loss_by_position ({bucket: loss}), training_loss ([[step, loss]])."""
    by_position = {b["bucket"]: b["loss"] for b in row["loss_by_position"] or []}
    nested = {"variant_params": json.dumps(row["variant_params"]), "loss_by_position": json.dumps(by_position),
              "training_loss": json.dumps(row.get("training_loss") or [])}
    if "accuracy_by_distance" in row:
        by_distance = {b["bucket"]: b["accuracy"] for b in row["accuracy_by_distance"] or []}
        nested["accuracy_by_distance"] = json.dumps(by_distance)
    return {**row, **nested}


def write_report(cfg: dict, rows: list[dict], out: Path, config_path: str, minutes: float,
                 sweeps: list[dict] | None = None) -> list[dict]:
    summary = summarize(rows, sweeps)
    record = {"config": cfg, "packages": package_versions(), "runs": rows, "summary": summary, "sweeps": sweeps or []}
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    write_csv(out / "results.csv", [csv_row(r) for r in rows], list(dict.fromkeys(k for r in rows for k in r)))
    write_plots(summary, out)
    (out / "results.md").write_text(markdown_report(cfg, summary, config_path, minutes, sweeps))
    return summary


# ---------------------------------------------------------------------------------------------------
# entry point


def check_output_dir(out: Path, overwrite: bool, resume: bool = False) -> None:
    if (out / "results.json").exists() and not (overwrite or resume):
        raise FileExistsError(
            f"{out} already holds a comparison; pass --resume to reuse its finished runs, --overwrite to replace it, "
            "or another --output_dir."
        )
    out.mkdir(parents=True, exist_ok=True)


def compare(config_path: str, output_dir: str | None = None, overwrite: bool = False,
            resume: bool = False) -> list[dict]:
    started = time.perf_counter()
    cfg = load_compare_config(config_path)
    out = Path(output_dir or cfg.get("output_dir") or "outputs/compare")
    cfg["output_dir"] = str(out)
    entries = plan_entries(cfg, out)
    check_output_dir(out, overwrite, resume)
    rows: list[dict] = []
    sweeps: list[dict] = []
    total = sum(len(e.seeds) + (len(e.learning_rates) - 1 if e.learning_rates else 0) for e in entries)
    progress = tqdm(total=total, desc="compare", unit="run", dynamic_ncols=True)

    def execute(run: Run) -> tuple[Outcome, dict]:
        rate = f" lr {run.config['learning_rate']:g}" if run.learning_rates else ""
        progress.set_postfix_str(f"{run.task} / {run.name} / seed {run.seed}{rate}")
        outcome = reusable(run) if resume else None
        reused = outcome is not None
        outcome = outcome or launch(run, cfg["launcher"], cfg["timeout_minutes"] * 60)
        row = row_for(run, outcome)
        rows.append(row)
        metric, label = KINDS[run.kind].headline
        value = outcome.results.get("metrics", {}).get(metric)
        detail = f"{label} {value:.4f}" if value is not None else outcome.error[:200]
        status = f"{outcome.status} (reused)" if reused else outcome.status
        progress.write(f"{run.task:>10} / {run.name:<20} seed {run.seed}{rate}: {status}  {detail}")
        progress.update(1)
        return outcome, row

    def partial_report() -> None:
        write_report(cfg, rows, out, config_path, (time.perf_counter() - started) / 60, sweeps)

    for entry in entries:
        if entry.learning_rates is None:
            for run in entry.first_runs():
                execute(run)
                partial_report()
            continue
        outcomes, swept = {}, []
        sweeps.append(sweep_record(entry, outcomes))  # every rate pending: the report lists the sweep as it goes
        for rate, run in zip(entry.learning_rates, entry.first_runs(), strict=True):
            outcomes[rate], row = execute(run)
            swept.append((rate, row))
            sweeps[-1] = sweep = sweep_record(entry, outcomes)
            partial_report()
        for rate, row in swept:
            row["sweep"] = "no rate chosen" if sweep["chosen"] is None else \
                "chosen" if rate == sweep["chosen"] else "not chosen"
        if sweep["chosen"] is None:
            progress.update(len(entry.seeds) - 1)
            continue
        for seed in entry.seeds[1:]:  # the first seed's run at the chosen rate is that seed's run
            _, row = execute(entry.run(seed, sweep["chosen"]))
            row["sweep"] = "chosen"
            partial_report()
    progress.close()
    summary = write_report(cfg, rows, out, config_path, (time.perf_counter() - started) / 60, sweeps)
    print(f"report: {out / 'results.md'}")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Compare attention-zoo variants: one fine-tune per variant.")
    parser.add_argument("config", help="compare config, e.g. recipes/configs/compare_default.yaml")
    parser.add_argument("--output_dir", "--output-dir", help="overrides the config's output_dir")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--overwrite", action="store_true", help="replace a comparison already in output_dir")
    again.add_argument("--resume", action="store_true",
                       help="reuse the runs in output_dir that finished with the planned config; run the others")
    args = parser.parse_args(argv)
    summary = compare(args.config, args.output_dir, args.overwrite, **({"resume": True} if args.resume else {}))
    failed = [f"{r['task']} / {r['name']}: {r['status']}" for r in summary if r["status"] in FAILED]
    if failed:
        raise SystemExit(f"{len(failed)} run(s) did not finish (see the report): " + "; ".join(failed))


if __name__ == "__main__":
    main()
