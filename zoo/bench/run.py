"""The layer benchmark's loop: every length, every contestant inside it (drift hits all alike), skipped or measured
in its own process, then the error check of each contestant; the result is the report dict of
:mod:`zoo.bench.report`."""

from __future__ import annotations

import statistics
from typing import Any

from zoo.bench.contestants import Contestant, FailedContestant
from zoo.bench.measure import Runner, measure_error, measure_idle, measure_roof, measure_time
from zoo.bench.plan import BenchSettings, History, skip_reason, total_flops
from zoo.bench.report import assemble_report
from zoo.reporting import MB


def _row(contestant: Contestant, n: int, **values: Any) -> dict[str, Any]:
    row = {"variant": contestant.name, "kind": contestant.kind, "n": n, "status": "ok", "note": ""}
    row.update(values)
    return row


def _measure_row(contestant, settings, n, runner, history, baseline) -> dict[str, Any]:
    if isinstance(contestant, FailedContestant):
        return _row(contestant, n, status="error", note=f"error: {contestant.error}")
    note, est_time = skip_reason(contestant, settings, n, history, baseline)
    if note:
        return _row(contestant, n, status="skipped", note=note)
    timeout = 60 + 3 * settings.max_seconds * (settings.warmup + 2)
    result = runner.run(measure_time, contestant, settings, n, timeout=timeout)
    if result["status"] != "ok":
        if result.get("fatal") or "memory" in result["error"].lower():
            history.failed_at, history.failure = n, result["error"]
        return _row(contestant, n, status="error", note=f"error: {result['error']}")
    seconds = statistics.median(result["times"])
    if settings.device == "cuda":
        peak, net = result["peak_bytes"], result["peak_bytes"] - result["baseline_bytes"]
    else:
        peak, net = result["max_rss_bytes"], result["max_rss_bytes"] - baseline
    history.times.append((n, seconds))
    history.memory.append((n, max(net, 1.0)))
    flops = total_flops(contestant, settings, n)
    return _row(
        contestant, n, time_s=seconds, time_min_s=min(result["times"]), repeats=len(result["times"]),
        peak_mb=peak / MB, mem_mb=net / MB, gflop=flops / 1e9, gflop_per_s=flops / seconds / 1e9,
        est_time_s=est_time,
    )


def _error_entry(contestant: Contestant, settings: BenchSettings, runner: Runner) -> dict[str, Any]:
    n = settings.error_length
    if isinstance(contestant, FailedContestant):
        return {"rel_error": None, "error_note": f"error: {contestant.error}"}
    reason = contestant.unsupported(n, settings.causal)  # measured in eval mode: dropout does not matter
    if reason:
        return {"rel_error": None, "error_note": f"n/a at n={n}: {reason}"}
    if not contestant.has_reference:
        return {"rel_error": None, "error_note": "n/a: its random blocks are drawn inside transformers"}
    result = runner.run(measure_error, contestant, settings, timeout=600)
    if result["status"] != "ok":
        return {"rel_error": None, "error_note": f"error: {result['error']}"}
    return {"rel_error": result["rel_error"], "error_note": ""}


def measure_baselines(runner: Runner, settings: BenchSettings, bar) -> tuple[dict[str, Any], float]:
    """The matmul roof and, on CPU, the max RSS of an idle measuring process (what memory rows are net of)."""
    bar.set_postfix_str("matmul roof")
    roof = runner.run(measure_roof, settings, timeout=600)
    bar.update()
    baseline = 0.0
    if runner.isolated:
        bar.set_postfix_str("idle process")
        baseline = float(runner.run(measure_idle, timeout=600).get("max_rss_bytes", 0))
    bar.update()
    return roof, baseline


def run_benchmark(settings: BenchSettings, contestants: list[Contestant], progress: bool = True) -> dict[str, Any]:
    """Measure every contestant at every length; returns the report dict (see :func:`zoo.bench.report`)."""
    from tqdm.auto import tqdm

    settings.check()
    runner = Runner(settings, contestants)
    total = 2 + len(settings.lengths) * len(contestants) + len(contestants)
    bar = tqdm(total=total, desc="zoo bench", unit="run", disable=not progress)
    roof, baseline = measure_baselines(runner, settings, bar)
    histories = {c.name: History() for c in contestants}
    rows = []
    for n in sorted(set(settings.lengths)):  # lengths outside, contestants inside: drift hits all alike
        for contestant in contestants:
            bar.set_postfix_str(f"{contestant.name} n={n}")
            rows.append(_measure_row(contestant, settings, n, runner, histories[contestant.name], baseline))
            bar.update()
    errors = {}
    for contestant in contestants:
        bar.set_postfix_str(f"{contestant.name} error at n={settings.error_length}")
        errors[contestant.name] = _error_entry(contestant, settings, runner)
        bar.update()
    bar.close()
    return assemble_report(settings, contestants, rows, errors, roof, baseline)
