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

The run loop and the command line; the pieces beside it: :mod:`~zoo.training.compare_plan` (the config, entries and
runs), :mod:`~zoo.training.compare_launch` (a run's process, its error, ``--resume``),
:mod:`~zoo.training.compare_sweep` (learning-rate sweeps) and :mod:`~zoo.training.compare_report` (rows, summary,
files and charts). Their names are importable from here as before.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm.auto import tqdm

from zoo.training.compare_launch import (
    command_for,
    last_error,
    launch,
    reusable,
    root_cause_rank,
    unavailable_reason,
)
from zoo.training.compare_plan import (
    COMPARE_KEYS,
    TASK_KEYS,
    Entry,
    Outcome,
    Run,
    load_compare_config,
    plan_entries,
    plan_runs,
    sweep_grid,
    variant_label,
)
from zoo.training.compare_report import (
    METRIC_COLUMNS,
    SPEED_COLUMNS,
    bubble_chart,
    csv_row,
    markdown_report,
    mean_loss_by_position,
    mean_training_loss,
    plot_name,
    row_for,
    summarize,
    training_loss,
    write_plots,
    write_report,
)
from zoo.training.compare_sweep import EDGE_NOTE, finite, sweep_lines, sweep_record, validation_key
from zoo.training.kinds import KINDS
from zoo.training.numerics import pinned_env

__all__ = [
    "COMPARE_KEYS", "EDGE_NOTE", "FAILED", "KINDS", "METRIC_COLUMNS", "SPEED_COLUMNS", "TASK_KEYS", "Entry",
    "Outcome", "Run", "bubble_chart", "check_output_dir", "command_for", "compare", "csv_row", "finite",
    "last_error", "launch", "load_compare_config", "main", "markdown_report", "mean_loss_by_position",
    "mean_training_loss", "plan_entries", "plan_runs", "plot_name", "reusable", "root_cause_rank", "row_for",
    "summarize", "sweep_grid", "sweep_lines", "sweep_record", "training_loss", "unavailable_reason",
    "validation_key", "variant_label", "write_plots", "write_report",
]

FAILED = ("failed", "timeout")  # statuses that make the command exit non-zero (after writing the report)




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
        outcome = outcome or launch(run, cfg["launcher"], cfg["timeout_minutes"] * 60, pinned_env(cfg["cpu_isa"]))
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
