"""The report of a ``zoo eval`` run folder: ``results.md`` (the headline table: task average per length with its
95% interval, share of the reference, cache bytes, prefill, decode and peak RSS; then per length every task; which
tasks separate the policies; the zoo's best policy against kvpress's best press per budget; perplexity by position),
``results.csv`` (a row per contestant x task x length), ``results.json`` and three plots (score by length per task,
score against cache bytes, needle depth x length for ``niah_single``). kvpress's rows are scored here from their
outputs and the prompts' answers, as the zoo's are. Rows are found by their contestant's fields (:mod:`zoo.eval.rows`:
the zoo's full cache is the reference whatever its name), never by their names.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from zoo.bench.report import write_report
from zoo.eval.rows import FIELDS, is_peer_reference, is_reference, with_fields
from zoo.eval.scoring import intervals_overlap, paired_share, sample_score, summarize
from zoo.eval.tasks import Sample
from zoo.reporting import human_bytes, markdown_table, pyplot, read_jsonl, save_figure, write_csv


def _rows(path: Path) -> list[dict]:
    """The rows of a run folder's JSON-lines file, each with its contestant's fields."""
    return [with_fields(row) for row in read_jsonl(path)]


def _first_ok(rows: list[dict], key) -> list[dict]:
    unique: dict[Any, dict] = {}
    for row in rows:
        if "error" not in row:
            unique.setdefault(key(row), row)
    return list(unique.values())


def score_peer_rows(rows: list[dict], samples: dict[tuple[str, int, int], Sample]) -> list[dict]:
    """kvpress rows (outputs only) scored against the prompts' answers, in the zoo's row format."""
    scored = []
    for row in rows:
        if "error" in row or "outputs" not in row:
            continue
        mine = [samples[(row["task"], row["length"], i)] for i in row["indices"]]
        scores = [sample_score(s, text) for s, text in zip(mine, row["outputs"], strict=True)]
        depths = [samples[(row["task"], row["length"], i)].depth for i in row["indices"]]
        scored.append({**row, "family": "kvpress", "kept": row["budget"], "scores": scores, "depths": depths,
                       **summarize(scores)})
    return scored


def load_results(out: Path) -> dict[str, Any]:
    """Every measurement of a run folder, deduplicated (a contestant x task x length measured twice: its first row)."""
    samples = {(s.task, s.length, s.index): s for s in (Sample.from_json(r) for r in _rows(out / "prompts.jsonl"))}
    cells = {(task, length) for task, length, _ in samples}
    peer = [r for r in _rows(out / "kvpress.jsonl") if (r["task"], r["length"]) in cells]
    answers = [r for r in _rows(out / "answers.jsonl") + score_peer_rows(peer, samples)
               if (r["task"], r["length"]) in cells]  # a resumed run that dropped a task or length reports without it
    return {
        "answers": _first_ok(answers, lambda r: (r["contestant"], r["task"], r["length"])),
        "errors": [r for r in _rows(out / "answers.jsonl") + peer
                   if "error" in r and (r["task"], r["length"]) in cells],
        "perplexity": _first_ok(_rows(out / "perplexity.jsonl"), lambda r: (r["contestant"], r["length"])),
        "speed": _first_ok(_rows(out / "speed.jsonl"), lambda r: (r["contestant"], r["length"])),
        "speed_errors": [r for r in _rows(out / "speed.jsonl") if "error" in r],
        "samples": samples,
    }


def averages(answers: list[dict]) -> dict[str, dict[int, dict]]:
    """contestant -> length -> the task average (mean of the task scores) and the pooled 95% interval."""
    table: dict[str, dict[int, dict]] = {}
    for name in dict.fromkeys(r["contestant"] for r in answers):
        mine = [r for r in answers if r["contestant"] == name]
        for length in sorted({r["length"] for r in mine}):
            here = [r for r in mine if r["length"] == length]
            pooled = summarize([s for r in here for s in r["scores"]])
            table.setdefault(name, {})[length] = {**pooled, "score": statistics.fmean(r["score"] for r in here),
                                                  "tasks": len(here)}
    return table


def reference_name(answers: list[dict]) -> str | None:
    """The name of the zoo's full cache (:func:`~zoo.eval.rows.is_reference`), or None when the run has none."""
    return next((r["contestant"] for r in answers if is_reference(r)), None)


def reference_cells(answers: list[dict], lengths: list[int]) -> set[tuple[str, int]]:
    """The task x length cells of ``lengths`` the reference row has (every cell when there is no reference)."""
    cells = {(r["task"], r["length"]) for r in answers if r["length"] in lengths}
    mine = {(r["task"], r["length"]) for r in answers if is_reference(r)}
    return cells & mine if mine else cells


def overall(answers: list[dict], lengths: list[int], cells: set[tuple[str, int]] | None = None) -> dict[str, dict]:
    """contestant -> the score over its samples of the ``cells`` (default: the reference's at ``lengths``) with the
    95% interval: the mean over those samples (at one length every task has as many samples: the task average)."""
    cells = reference_cells(answers, lengths) if cells is None else cells
    result = {}
    for name in dict.fromkeys(r["contestant"] for r in answers):
        here = [r for r in answers if r["contestant"] == name and (r["task"], r["length"]) in cells]
        if here:
            result[name] = {**summarize([s for r in here for s in r["scores"]]), "cells": len(here)}
    return result


def shares_of_reference(answers: list[dict], lengths: list[int]) -> dict[str, dict | None]:
    """contestant -> its share of the reference's score over the reference's cells at ``lengths``, with the paired
    bootstrap interval (:func:`~zoo.eval.scoring.paired_share`); only contestants that answered every such cell with
    the reference's sample count."""
    name = reference_name(answers)
    cells = sorted(reference_cells(answers, lengths))
    if name is None or not cells:
        return {}
    by_key = {(r["contestant"], r["task"], r["length"]): r["scores"] for r in answers}
    theirs = [by_key[(name, *cell)] for cell in cells]
    shares = {}
    for contestant in dict.fromkeys(r["contestant"] for r in answers):
        mine = [by_key.get((contestant, *cell)) for cell in cells]
        if all(m is not None and len(m) == len(t) for m, t in zip(mine, theirs, strict=True)):
            shares[contestant] = paired_share(mine, theirs)
    return shares


def common_lengths(answers: list[dict]) -> list[int]:
    """The lengths at which more than one task was measured (the headline average's; a length of one task alone,
    such as a long needle check, is left to the per-task tables)."""
    at = {n: {r["task"] for r in answers if r["length"] == n} for n in {r["length"] for r in answers}}
    return sorted(n for n, here in at.items() if len(here) > 1 or len(at) == 1)


def _kept(row: dict) -> str:
    if is_reference(row) or is_peer_reference(row):
        return "100%"
    if row["family"] == "quantized":
        return f"{row['nbits']}-bit"
    return f"{row.get('kept', 1.0):.0%}"


def _cell(summary: dict | None) -> str:
    if summary is None:
        return "–"
    return f"{summary['score']:.2f} [{summary['low']:.2f}, {summary['high']:.2f}]"


def headline(results: dict[str, Any]) -> tuple[list[str], list[dict]]:
    answers, lengths = results["answers"], common_lengths(results["answers"])
    per_length, total = averages(answers), overall(answers, lengths)
    speed = {r["contestant"]: r for r in results["speed"]}
    info = {r["contestant"]: r for r in answers}
    reference = total.get(reference_name(answers), {}).get("score")
    longest = max(lengths) if lengths else None
    bytes_at = {r["contestant"]: r["cache_bytes"] for r in answers if r["length"] == longest}
    tasks_at = {n: len({r["task"] for r in answers if r["length"] == n}) for n in lengths}
    shares = shares_of_reference(answers, lengths)
    header = ["contestant", "kept", *[f"avg {n} ({tasks_at[n]} tasks)" for n in lengths], "average [95% CI]", "cells",
              "of full [paired 95%]",
              f"cache at {longest}", "prefill s", "decode ms/token", "peak RSS"]
    rows, records = [], []
    for name, summary in total.items():
        fast = speed.get(name, {})
        share = summary["score"] / reference if reference else None
        paired = shares.get(name)
        cells = [f"{per_length[name][n]['score']:.2f}" if n in per_length[name] else "–" for n in lengths]
        rows.append([name, _kept(info[name]), *cells, _cell(summary), summary["cells"],
                     "–" if share is None else f"{share:.0%}" + (
                         f" [{paired['low']:.0%}, {paired['high']:.0%}]" if paired else ""),
                     human_bytes(bytes_at[name]) if name in bytes_at else "–",
                     f"{fast['prefill_s']:.2f}" if "prefill_s" in fast else "–",
                     f"{fast['ms_per_token']:.1f}" if "ms_per_token" in fast else "–",
                     human_bytes(fast["peak_rss_bytes"]) if "peak_rss_bytes" in fast else "–"])
        records.append({"contestant": name, **{k: info[name][k] for k in FIELDS}, "kept": info[name].get("kept"),
                        **{f"avg_{n}": per_length[name].get(n, {}).get("score") for n in lengths}, **summary,
                        "share_of_full": share, "share_of_full_paired": paired, "cache_bytes": bytes_at.get(name),
                        **{k: fast.get(k) for k in (
                            "prefill_s", "ms_per_token", "peak_rss_bytes")}})
    return markdown_table(header, rows), records


def task_tables(answers: list[dict]) -> list[str]:
    lines = []
    tasks = list(dict.fromkeys(r["task"] for r in answers))
    by_key = {(r["contestant"], r["task"], r["length"]): r for r in answers}
    for length in sorted({r["length"] for r in answers}):
        here = [t for t in tasks if any(r["task"] == t and r["length"] == length for r in answers)]
        names = list(dict.fromkeys(r["contestant"] for r in answers if r["length"] == length))
        n = {t: next(r["n"] for r in answers if r["task"] == t and r["length"] == length) for t in here}
        lines += [f"### {length} tokens", "", *markdown_table(
            ["contestant", *[f"{t} (n={n[t]})" for t in here]],
            [[name, *[f"{by_key[(name, t, length)]['score']:.2f}" if (name, t, length) in by_key else "–"
                      for t in here]] for name in names]), ""]
    return lines


def separating_tasks(answers: list[dict], kept: float) -> list[str]:
    """Tasks (and lengths) on which two of the zoo's ``budget`` policies at ``kept`` have disjoint intervals."""
    found = []
    for (task, length) in dict.fromkeys((r["task"], r["length"]) for r in answers):
        group = [r for r in answers if r["family"] == "budget" and abs(r.get("kept", 0) - kept) < 1e-9
                 and r["task"] == task and r["length"] == length]
        low, high = min(group, key=lambda r: r["score"], default=None), max(group, key=lambda r: r["score"],
                                                                            default=None)
        if low is not None and not intervals_overlap(low, high):
            found.append(f"{task} @ {length}: {high['contestant']} {high['score']:.2f} vs {low['contestant']} "
                         f"{low['score']:.2f}")
    return found


def zoo_against_kvpress(answers: list[dict], lengths: list[int]) -> list[str]:
    """Per budget: the zoo's best policy and kvpress's best prefill press on the task average (overlapping
    intervals: a tie), and the tasks where their intervals do not overlap."""
    total = overall(answers, lengths)
    info = {r["contestant"]: r for r in answers}
    lines = []
    for kept in sorted({r["kept"] for r in answers if r["family"] in ("budget", "kvpress") and r["kept"] < 1},
                       reverse=True):
        def best(family: str, kept: float = kept) -> str | None:
            names = [n for n in total if info[n]["family"] == family and abs(info[n]["kept"] - kept) < 1e-9
                     and not info[n]["decoding"]]
            return max(names, key=lambda n: total[n]["score"], default=None)

        zoo, peer = best("budget"), best("kvpress")
        if zoo is None or peer is None:
            continue
        both = {(r["task"], r["length"]) for r in answers if r["contestant"] == zoo} & {
            (r["task"], r["length"]) for r in answers if r["contestant"] == peer}
        pair = overall([r for r in answers if r["contestant"] in (zoo, peer)], lengths, both)
        verdict = "tie (intervals overlap)" if intervals_overlap(pair[zoo], pair[peer]) else (
            "zoo ahead" if pair[zoo]["score"] > pair[peer]["score"] else "kvpress ahead")
        deciding = [f"{r['task']} @ {r['length']} ({r['score']:.2f} vs {o['score']:.2f})" for r in answers
                    if r["contestant"] == zoo and r["length"] in lengths for o in answers
                    if o["contestant"] == peer and (o["task"], o["length"]) == (r["task"], r["length"])
                    and not intervals_overlap(r, o)]
        lines.append(f"- {kept:.0%} ({len(both)} cells): zoo `{zoo}` {_cell(pair[zoo])} vs `{peer}` "
                     f"{_cell(pair[peer])}: {verdict}; tasks whose intervals do not overlap: "
                     f"{', '.join(deciding) or 'none'}")
    return lines


def peer_agreement(answers: list[dict]) -> str:
    """How often kvpress's uncompressed answers equal the zoo's full-cache answers (the two environments' sanity
    check: transformers 5.2 and 5.24 on the same prompts), and how often their scores do."""
    ours = {(r["task"], r["length"], i): (o, s) for r in answers if is_reference(r)
            for i, o, s in zip(r["indices"], r["outputs"], r["scores"], strict=True)}
    theirs = {(r["task"], r["length"], i): (o, s) for r in answers if is_peer_reference(r)
              for i, o, s in zip(r["indices"], r["outputs"], r["scores"], strict=True)}
    both = sorted(set(ours) & set(theirs))
    if not both:
        return "(no kvpress rows on the reference's samples)"
    same = sum(ours[k][0].strip() == theirs[k][0].strip() for k in both)
    scored = sum(ours[k][1] == theirs[k][1] for k in both)
    return (f"kvpress's `no press` against the zoo's `{reference_name(answers)}` on the same {len(both)} samples: "
            f"the same answer text {same} times, the same score {scored} times.")


def policy_robustness(answers: list[dict], lengths: list[int]) -> list[str]:
    """Per ``budget`` policy: the mean and the worst of its task x length x budget cells, best mean first."""
    policies: dict[str, list[float]] = {}
    for r in answers:
        if r["family"] == "budget" and r["length"] in lengths:
            policies.setdefault(r["policy"], []).append(r["score"])
    ranked = sorted(policies.items(), key=lambda item: -statistics.fmean(item[1]))
    return markdown_table(["policy", "mean over tasks x lengths x budgets", "worst cell", "cells"],
                          [[p, f"{statistics.fmean(v):.3f}", f"{min(v):.2f}", len(v)] for p, v in ranked])


def perplexity_table(rows: list[dict]) -> list[str]:
    lines = []
    for length in sorted({r["length"] for r in rows}):
        here = [r for r in rows if r["length"] == length]
        bucket = here[0]["bucket"]
        starts = [f"{i * bucket}-{(i + 1) * bucket}" for i in range(len(here[0]["bucket_ppl"]))]
        lines += [f"Perplexity by position, {length}-token documents ({here[0]['documents']} held-out stretches, fed "
                  f"{here[0]['chunk']} tokens at a time through each contestant's cache):", "",
                  *markdown_table(["contestant", *starts, "all", "cache"],
                                  [[r["contestant"], *[f"{p:.2f}" for p in r["bucket_ppl"]], f"{r['ppl']:.2f}",
                                    human_bytes(r["cache_bytes"])] for r in here]), ""]
    return lines


def plot_by_length(answers: list[dict], path: Path) -> None:
    plt = pyplot()
    tasks = list(dict.fromkeys(r["task"] for r in answers))
    columns = min(3, len(tasks))
    fig, axes = plt.subplots((len(tasks) + columns - 1) // columns, columns, figsize=(5 * columns, 3.4 * (
        (len(tasks) + columns - 1) // columns)), squeeze=False)
    names = list(dict.fromkeys(r["contestant"] for r in answers))
    for ax, task in zip(axes.flat, tasks, strict=False):
        for name in names:
            mine = sorted((r["length"], r["score"]) for r in answers if r["task"] == task and r["contestant"] == name)
            if mine:
                ax.plot(*zip(*mine, strict=True), marker="o", lw=1, label=name)
        ax.set(title=task, xscale="log", xlabel="tokens", ylabel="score", ylim=(-0.05, 1.05))
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=5, ncol=2)
    save_figure(fig, path)


def plot_frontier(records: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family in dict.fromkeys(r["family"] for r in records):
        mine = [r for r in records if r["family"] == family and r["cache_bytes"]]
        ax.errorbar([r["cache_bytes"] for r in mine], [r["score"] for r in mine],
                    yerr=[[r["score"] - r["low"] for r in mine], [r["high"] - r["score"] for r in mine]],
                    fmt="o", capsize=2, label=family)
    ax.set(xscale="log", xlabel="cache bytes per sequence after the answer (longest common length)",
           ylabel="task average", title="score against cache bytes")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_depths(answers: list[dict], path: Path, task: str = "niah_single") -> None:
    plt = pyplot()
    names = [n for n in dict.fromkeys(r["contestant"] for r in answers if r["task"] == task)][:12]
    if not names:
        return
    lengths = sorted({r["length"] for r in answers if r["task"] == task})
    depths = sorted({round(d, 2) for r in answers if r["task"] == task for d in r["depths"] if d is not None})
    columns = min(4, len(names))
    rows = (len(names) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        grid = [[float("nan")] * len(lengths) for _ in depths]
        for r in answers:
            if r["task"] == task and r["contestant"] == name:
                for depth, value in zip(r["depths"], r["scores"], strict=True):
                    grid[depths.index(round(depth, 2))][lengths.index(r["length"])] = value
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set(title=name, xticks=range(len(lengths)), xticklabels=lengths, yticks=range(len(depths)),
               yticklabels=[f"{d:.0%}" for d in depths])
        ax.title.set_fontsize(7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    save_figure(fig, path)


def scorings(samples: dict[tuple[str, int, int], Sample]) -> str:
    """Which scoring each task used (:mod:`zoo.eval.scoring`)."""
    used: dict[str, set[str]] = {}
    for sample in samples.values():
        used.setdefault(sample.meta.get("scoring", "strict"), set()).add(sample.task)
    said = {"ruler": "`ruler` (RULER's string_match_all: case-insensitive substrings)",
            "strict": "`strict` (words as whole words, numbers not inside longer digit runs)"}
    return "Scoring: " + "; ".join(f"{said.get(name, name)} for {', '.join(sorted(tasks))}"
                                   for name, tasks in sorted(used.items())) + "."


def render(results: dict[str, Any], table: list[str]) -> str:
    answers, lengths = results["answers"], common_lengths(results["answers"])
    lines = ["# zoo eval", "", f"Task average = the mean of the task scores (the share of the expected strings found "
             f"in the greedy answer); the headline averages every task x length cell at {lengths}; intervals are 95% "
             "Wilson intervals over the pooled samples. Cache bytes per sequence after the answer.", "",
             scorings(results["samples"]), "", *table, "",
             "## Per task", "", *task_tables(answers), "## The zoo's best policy against kvpress's best press", "",
             *(zoo_against_kvpress(answers, lengths) or ["(no kvpress rows)"]), "", peer_agreement(answers), "",
             "## Policies", "",
             *policy_robustness(answers, lengths), ""]
    for kept in sorted({r["kept"] for r in answers if r["family"] == "budget"}, reverse=True):
        lines += [f"Tasks separating the policies at {kept:.0%} (disjoint intervals): "
                  f"{'; '.join(separating_tasks(answers, kept)) or 'none'}", ""]
    if results["perplexity"]:
        lines += ["## Perplexity by position", "", *perplexity_table(results["perplexity"])]
    errors = results["errors"] + results["speed_errors"]
    if errors:
        lines += ["## Errors", "", *[f"- {r.get('contestant')} {r.get('task', 'speed')} {r.get('length')}: "
                                     f"{r['error']}" for r in errors], ""]
    return "\n".join(lines)


def write_eval_report(out: Path) -> dict[str, Path]:
    """Write the report files of the run folder ``out``; returns their paths."""
    results = load_results(out)
    table, records = headline(results)
    answers = results["answers"]
    fields = ["contestant", "source", "family", "policy", "kept", "task", "length", "score", "low", "high", "n",
              "cache_bytes"]
    files: dict[str, tuple[str, Any]] = {
        "md": ("results.md", render(results, table)),
        "csv": ("results.csv", lambda p: write_csv(p, answers, fields)),
        "json": ("results.json", json.dumps({"headline": records, "answers": [
            {k: v for k, v in r.items() if k != "outputs"} for r in answers], "perplexity": results["perplexity"],
            "speed": results["speed"]}, indent=1)),
    }
    if answers:
        files["by_length"] = ("score_by_length.png", lambda p: plot_by_length(answers, p))
        files["frontier"] = ("score_vs_cache_bytes.png", lambda p: plot_frontier(records, p))
        files["depths"] = ("niah_single_depths.png", lambda p: plot_depths(answers, p))
    return write_report(out, files)
