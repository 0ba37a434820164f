"""Learning-rate sweeps of a comparison (:mod:`zoo.training.compare`): each rate of an entry's grid on its first
seed, the rate with the best validation metric chosen (ties: the lower validation loss, then the smaller rate), and
the report's section listing them.
"""

from __future__ import annotations

import math
from typing import Any

from zoo.reporting import fixed, markdown_table
from zoo.training.compare_plan import Entry, Outcome
from zoo.training.kinds import KINDS


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
