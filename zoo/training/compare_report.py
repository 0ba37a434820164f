"""The report of a comparison (:mod:`zoo.training.compare`): a row per run, a summary per (task, entry) over its
seeds, ``results.md`` / ``.csv`` / ``.json`` and the per-task charts.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from zoo.reporting import REPOSITORY, pyplot, read_jsonl, relative_path, save_figure, write_csv
from zoo.training.compare_plan import Outcome, Run
from zoo.training.compare_sweep import EDGE_NOTE, sweep_lines
from zoo.training.kinds import KINDS
from zoo.training.results import package_versions

METRIC_COLUMNS = ("eval_accuracy", "eval_macro_f1", "eval_loss", "eval_perplexity")
SPEED_COLUMNS = (
    "train_tokens_per_second", "eval_tokens_per_second", "decode_tokens_per_second", "peak_memory_mb",
    "wall_time_seconds",
)  # fmt: skip


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
    row["training_curves"] = results.get("training_curves") or {}  # indexer_kl, distill_kl: [[step, mean], ...]
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
        names = dict.fromkeys(name for r in done for name in r.get("training_curves") or {})
        entry["training_curves"] = {
            name: mean_training_loss([(r.get("training_curves") or {}).get(name, []) for r in done]) for name in names
        }
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
    records = read_jsonl(Path(run_dir) / "train_log.jsonl")
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
        lines += curve_lines(rows)
        if any(r["training_loss"] for r in rows):
            lines.append(f"![training loss]({plot_name('training_loss', task)})")
        lines += [f"![{alt}]({plot_name(name, task)})" for alt, name in kind.images]
    lines += sweep_lines(sweeps or [])
    return "\n".join(lines) + "\n"


def curve_lines(rows: list[dict]) -> list[str]:
    """What each entry logged beside its training loss (DSA's ``indexer_kl``, ``distill_kl``): first -> last value."""
    found = [
        (r["name"], name, curve) for r in rows for name, curve in (r.get("training_curves") or {}).items() if curve
    ]
    if not found:
        return []
    lines = ["", "Logged beside the training loss (mean over seeds; first -> last logged step):", ""]
    return lines + [
        f"- **{entry}**: {name} {curve[0][1]:.4g} (step {curve[0][0]}) -> {curve[-1][1]:.4g} (step {curve[-1][0]})"
        for entry, name, curve in found
    ]


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
    """Nested values as JSON text: variant_params, loss_by_position ({bucket: loss}), training_loss ([[step, loss]]),
    training_curves ({name: [[step, value]]})."""
    by_position = {b["bucket"]: b["loss"] for b in row["loss_by_position"] or []}
    nested = {
        "variant_params": json.dumps(row["variant_params"]),
        "loss_by_position": json.dumps(by_position),
        "training_loss": json.dumps(row.get("training_loss") or []),
        "training_curves": json.dumps(row.get("training_curves") or {}),
    }
    if "accuracy_by_distance" in row:
        by_distance = {b["bucket"]: b["accuracy"] for b in row["accuracy_by_distance"] or []}
        nested["accuracy_by_distance"] = json.dumps(by_distance)
    return {**row, **nested}


def write_report(cfg: dict, rows: list[dict], out: Path, config_path: str, minutes: float,
                 sweeps: list[dict] | None = None) -> list[dict]:
    summary = summarize(rows, sweeps)
    rows = [{**row, "run_dir": relative_path(row["run_dir"], out)} for row in rows]  # the folder may move
    recorded = {**cfg, "output_dir": relative_path(out, REPOSITORY, root=out)}  # in the repository, else "."
    record = {"config": recorded, "packages": package_versions(), "runs": rows, "summary": summary,
              "sweeps": sweeps or []}
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    write_csv(out / "results.csv", [csv_row(r) for r in rows], list(dict.fromkeys(k for r in rows for k in r)))
    write_plots(summary, out)
    (out / "results.md").write_text(markdown_report(cfg, summary, config_path, minutes, sweeps))
    return summary
