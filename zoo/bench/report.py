"""The report of ``zoo bench``: the raw rows turned into ratios, fitted exponents and roof fractions, and
rendered as CSV, JSON, markdown and log-log plots.

A row is a dict with at least ``variant`` (the contestant's name), ``n`` and ``status`` (``ok``, ``skipped`` or
``error``, with the reason in ``note``). The table, CSV and plot helpers take their columns, cells and series
from the caller, so another mode of the benchmark (e.g. decoding) renders its own rows with them.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from zoo.bench.contestants import Contestant
from zoo.bench.plan import FIT_FROM, fit_exponent
from zoo.reporting import MB, fixed, human_bytes, markdown_table, pyplot, save_figure, write_csv

WALL_LENGTHS = [512, 2048, 8192, 32768]
MARKERS = "os^vD<>phX*"
# A slope through two points fits them exactly whatever the noise; three lengths at least make it a measurement.
MIN_FIT_LENGTHS = 3
CSV_FIELDS = [
    "variant", "kind", "n", "status", "note", "time_s", "time_min_s", "repeats", "mem_mb", "peak_mb", "gflop",
    "gflop_per_s", "roof_pct", "speedup_vs_sdpa", "mem_vs_sdpa", "peer", "speedup_vs_peer", "mem_vs_peer",
    "rel_error", "error_n", "error_note", "est_time_s",
]
SETTINGS_COLUMNS = ["batch", "hidden", "heads", "dtype", "mode", "causal", "device", "threads", "dropout"]


# ---------------------------------------------------------------------------------------------------
# assembly


def machine_info(settings) -> dict[str, Any]:
    """CPU (or GPU), cores, memory and package versions: where the numbers come from."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_total": human_bytes(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": settings.threads,
    }
    if settings.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def peers_of(name: str, contestants: list[Contestant]) -> list[str]:
    return [c.name for c in contestants if name in c.matches]


def describe_contestant(c: Contestant, contestants: list[Contestant]) -> dict[str, Any]:
    """What the report says about a contestant besides its measurements."""
    distribution, version = c.source()
    return {
        "kind": c.kind,
        "package": distribution,
        "version": version,
        "params": c.params,
        "exact": c.exact,
        "time_complexity": c.time_complexity,
        "memory_complexity": c.memory_complexity,
        "peers": peers_of(c.name, contestants),
    }


def assemble_report(settings, contestants, rows, errors, roof, baseline) -> dict[str, Any]:
    """Add ratios (against sdpa and the matching peers), exponents and the roof fraction to the raw rows."""
    roof_gflops = roof.get("gflop_per_s") if roof.get("status") == "ok" else None
    by_key = {(r["variant"], r["n"]): r for r in rows if r["status"] == "ok"}
    for row in rows:
        row.update(errors.get(row["variant"], {}), error_n=settings.error_length)
        if row["status"] != "ok":
            continue
        if roof_gflops:
            row["roof_pct"] = 100.0 * row["gflop_per_s"] / roof_gflops
        sdpa = by_key.get(("sdpa", row["n"]))
        if sdpa:
            row["speedup_vs_sdpa"] = sdpa["time_s"] / row["time_s"]
            row["mem_vs_sdpa"] = row["mem_mb"] / sdpa["mem_mb"] if sdpa["mem_mb"] > 0 else None
        for peer_name in peers_of(row["variant"], contestants)[:1]:  # the CSV keeps the first (transformers) peer
            peer = by_key.get((peer_name, row["n"]))
            row["peer"] = peer_name
            if peer:
                row["speedup_vs_peer"] = peer["time_s"] / row["time_s"]
                row["mem_vs_peer"] = row["mem_mb"] / peer["mem_mb"] if peer["mem_mb"] > 0 else None
    variants = {}
    for c in contestants:
        ok = [r for r in rows if r["variant"] == c.name and r["status"] == "ok"]
        if len({r["n"] for r in ok}) < MIN_FIT_LENGTHS:
            ok = []  # too few lengths: no exponent (the report says why)
        variants[c.name] = {
            **describe_contestant(c, contestants),
            "time_exponent": fit_exponent([r["n"] for r in ok], [r["time_s"] for r in ok]),
            "memory_exponent": fit_exponent([r["n"] for r in ok], [r["mem_mb"] for r in ok]),
            **errors.get(c.name, {}),
        }
    return {
        "settings": asdict(settings),
        "machine": machine_info(settings),
        "roof_gflop_per_s": roof_gflops,
        "roof_note": "" if roof_gflops else roof.get("error", ""),
        "baseline_rss_mb": baseline / MB,
        "variants": variants,
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------------
# generic rendering: rows of (variant, n, status, ...) with the columns and cells the caller gives


def short_note(row: dict[str, Any]) -> str:
    """A skip note in full (it says why); an error as its exception type (the message is listed under Errors)."""
    if row["status"] == "error":
        return row["note"].split(":", 2)[0] + ": " + row["note"].split(":", 2)[1].strip() + " (see Errors)"
    return row["note"]


def grid(rows: list[dict[str, Any]], names, cell: Callable[[dict], str], label: str = "variant") -> list[str]:
    """A markdown table: one line per name, one column per length; ``cell(row)`` for measured rows, the note for
    the others."""
    lengths = sorted({r["n"] for r in rows})
    lines = []
    for name in names:
        cells = []
        for n in lengths:
            row = next(r for r in rows if r["variant"] == name and r["n"] == n)
            cells.append(cell(row) if row["status"] == "ok" else short_note(row))
        lines.append([name, *cells])
    return markdown_table([label, *(f"n={n}" for n in lengths)], lines)


def errors_section(rows: list[dict[str, Any]], checks: dict[str, str] | None = None) -> list[str]:
    """Each distinct error message once, with the lengths it happened at; ``checks`` maps a name to the note of
    a further check (``where: note``), listed when it is an error."""
    seen: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        if row["status"] == "error":
            seen.setdefault((row["variant"], row["note"]), []).append(f"n={row['n']}")
    for name, (where, note) in (checks or {}).items():
        if note.startswith("error"):
            seen.setdefault((name, note), []).append(where)
    return [f"- **{name}** ({', '.join(where)}): {note}" for (name, note), where in seen.items()] or ["none"]


def plot_against_n(rows: list[dict[str, Any]], styles: dict[str, str], key: str, ylabel: str, title: str,
                   path: Path) -> None:
    """Log-log plot of ``row[key]`` against n, one line per name in ``styles`` (its matplotlib line style), with
    grey O(n) and O(n²) guides from the lowest first point."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    lengths = sorted({r["n"] for r in rows})
    palette = plt.get_cmap("tab20").colors
    colors = palette[0::2] + palette[1::2]  # the 10 strong colours first, their light twins after
    lowest = []
    for i, (name, style) in enumerate(styles.items()):
        ok = [r for r in rows if r["variant"] == name and r["status"] == "ok" and r[key] > 0]
        if ok:
            # a marker of its own per line: lines that coincide (equal cache bytes) stay distinguishable
            ax.plot([r["n"] for r in ok], [r[key] for r in ok], style, marker=MARKERS[i % len(MARKERS)],
                    markersize=7 - 3 * (i % 2), markerfacecolor="none", label=name, color=colors[i % len(colors)])
            lowest.append(min(r[key] for r in ok if r["n"] == ok[0]["n"]))
    if lowest and len(lengths) > 1:  # guides: how O(n) and O(n²) would grow from the lowest first point
        start = min(lowest)
        for power, label in ((1, "∝ n"), (2, "∝ n²")):
            ax.plot(lengths, [start * (n / lengths[0]) ** power for n in lengths], ":", color="grey", linewidth=1)
            ax.annotate(label, (lengths[-1], start * (lengths[-1] / lengths[0]) ** power), color="grey", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths], rotation=45)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------------
# the layer benchmark's tables


def _ratio_cell(speed: float | None, memory: float | None) -> str:
    if speed is None:
        return "–"
    return f"{speed:.2f}x speed, {fixed(memory)}x memory"


def _peer_pairs_table(report) -> list[str]:
    lengths = sorted({r["n"] for r in report["rows"]})
    ok = {(r["variant"], r["n"]): r for r in report["rows"] if r["status"] == "ok"}
    lines = []
    for name, info in report["variants"].items():
        for peer in info["peers"]:
            cells = []
            for n in lengths:
                mine, theirs = ok.get((name, n)), ok.get((peer, n))
                if mine and theirs:
                    memory = mine["mem_mb"] / theirs["mem_mb"] if theirs["mem_mb"] > 0 else None
                    cells.append(_ratio_cell(theirs["time_s"] / mine["time_s"], memory))
                else:
                    cells.append("–")
            lines.append([f"{name} vs {peer}", *cells])
    return markdown_table(["variant vs peer", *(f"n={n}" for n in lengths)], lines)


def _summary_table(report) -> list[str]:
    header = ["variant", "source", "params", "time, memory", "time exponent", "memory exponent",
              "GFLOP/s at largest n", "% of roof", "rel. error"]
    lines = []
    for name, info in report["variants"].items():
        ok = [r for r in report["rows"] if r["variant"] == name and r["status"] == "ok"]
        last = ok[-1] if ok else {}
        at = f" (n={last['n']})" if last else ""
        error = fixed(info.get("rel_error"), 4) if info.get("rel_error") is not None else info.get("error_note", "")
        if error.startswith("error"):
            error = "error (see Errors)"
        params = ", ".join(f"{k}={v}" for k, v in info["params"].items()) or "-"
        lines.append([
            name, f"{info['package']} {info['version']}", params,
            f"{info['time_complexity']}, {info['memory_complexity']}",
            fixed(info["time_exponent"]), fixed(info["memory_exponent"]),
            f"{fixed(last.get('gflop_per_s'), 1)}{at}", fixed(last.get("roof_pct"), 1), error,
        ])
    return markdown_table(header, lines)


def _wall_measured(report) -> bool:
    """Some contestant was measured at two or more of the wall's lengths (else the table compares nothing)."""
    ok = {(r["variant"], r["n"]) for r in report["rows"] if r["status"] == "ok"}
    return any(sum((name, n) in ok for n in WALL_LENGTHS) >= 2 for name in report["variants"])


def _wall_table(report) -> list[str]:
    """The seed's table: attention-matrix size and theoretical O(n²) cost beside measured relative cost."""
    if not _wall_measured(report):
        return [f"Omitted: no contestant was measured at two of n = {', '.join(map(str, WALL_LENGTHS))} "
                "(run without --quick, or pass those --lengths)."]
    heads = report["settings"]["heads"]
    base = WALL_LENGTHS[0]
    lines = [
        ["attention matrix entries per head (n²)", *(f"{n * n:,}" for n in WALL_LENGTHS)],
        [f"fp32 scores, {heads} heads, one layer", *(human_bytes(4 * heads * n * n) for n in WALL_LENGTHS)],
        ["theoretical relative cost O(n²)", *(f"{(n / base) ** 2:,.0f}x" for n in WALL_LENGTHS)],
    ]
    ok = {(r["variant"], r["n"]): r for r in report["rows"] if r["status"] == "ok"}
    for name in report["variants"]:
        measured = [n for n in WALL_LENGTHS if (name, n) in ok]
        if not measured:
            continue
        first = ok[(name, measured[0])]
        cells = []
        for n in WALL_LENGTHS:
            row = ok.get((name, n))
            if row is None:
                other = next((r for r in report["rows"] if r["variant"] == name and r["n"] == n), None)
                cells.append(short_note(other) if other and other["status"] != "ok" else "–")
                continue
            memory = row["mem_mb"] / first["mem_mb"] if first["mem_mb"] > 0 else None
            cells.append(f"time {row['time_s'] / first['time_s']:,.1f}x, memory {fixed(memory, 1)}x")
        label = name if measured[0] == base else f"{name} (relative to n={measured[0]})"
        lines.append([f"{label}: measured", *cells])
    return markdown_table(["", *(f"n={n}" for n in WALL_LENGTHS)], lines)


def layer_description(s: dict[str, Any]) -> str:
    """The measured layer and mode in words (the markdown header)."""
    dropout = s.get("dropout", 0.0)
    mode = f"{s['mode']} with attention dropout {dropout:g} (training mode)" if dropout else s["mode"]
    return (
        f"One self-attention layer with its q/k/v projections: hidden {s['hidden']}, {s['heads']} heads, batch "
        f"{s['batch']}, {s['dtype']}, {mode}, {'causal' if s['causal'] else 'bidirectional'}, {s['device']}, "
        f"{s['threads']} threads; median of up to {s['repeats']} repeats after {s['warmup']} warm-up."
    )


def _fit_note(report) -> str:
    lengths = len({r["n"] for r in report["rows"]})
    return f": this run measured {lengths}, so the exponents are omitted" if lengths < MIN_FIT_LENGTHS else ""


def render_markdown(report: dict[str, Any], command: str) -> str:
    s, m = report["settings"], report["machine"]
    roof = report["roof_gflop_per_s"]
    where = m.get("gpu") or f"{m['cpu']}, {m['cpu_count']} cores, {m['memory_total']}"
    lines = [
        "# zoo bench",
        "",
        f"`{command}`",
        "",
        layer_description(s),
        f"Machine: {where}; torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}.",
        f"Dense-matmul roof measured in this run: {fixed(roof, 1)} GFLOP/s {report['roof_note']}".rstrip() + ".",
    ]
    if s["device"] == "cpu":
        lines.append(
            f"Memory: max RSS of the fresh process that ran the measurement minus that of an idle one "
            f"({report['baseline_rss_mb']:.0f} MB, torch and transformers imported); raw values in the CSV."
        )
    else:
        lines.append("Memory: torch.cuda.max_memory_allocated during the measurement.")
    error_mode = " (eval mode: no dropout)" if s.get("dropout") else ""
    rows, names = report["rows"], list(report["variants"])
    check = f"error check at n={s['error_length']}"
    sections = [
        ("Time (s)", grid(rows, names, lambda r: fixed(r["time_s"], 3))),
        ("Peak memory (MB above an idle process)", grid(rows, names, lambda r: fixed(r["mem_mb"], 0))),
        ("Against sdpa (speed = sdpa time / variant time, above 1 is faster; memory = variant / sdpa)",
         grid(rows, names, lambda r: _ratio_cell(r.get("speedup_vs_sdpa"), r.get("mem_vs_sdpa")))),
        ("Against the matching peer (speed = peer time / variant time, above 1 is faster; memory = variant / peer)",
         _peer_pairs_table(report)),
        (f"Per variant (exponents fitted on log-log over n >= {FIT_FROM} when two such lengths were measured, else "
         f"all; none from fewer than {MIN_FIT_LENGTHS} lengths, which any slope fits{_fit_note(report)}; error: "
         f"relative Frobenius error at n={s['error_length']}{error_mode} against softmax attention "
         f"restricted to the pattern, or full softmax for approximate variants)", _summary_table(report)),
        ("The O(n²) wall (measured values relative to each variant's own at the first length)",
         _wall_table(report)),
        ("Errors", errors_section(rows, {n: (check, i.get("error_note", "")) for n, i in report["variants"].items()})),
    ]
    for title, table in sections:
        lines += ["", f"## {title}", "", *table]
    lines += ["", "![time vs n](time_vs_n.png)", "", "![memory vs n](memory_vs_n.png)", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], key: str, ylabel: str, path: Path) -> None:
    s = report["settings"]
    styles = {name: "--" if info["kind"] == "peer" else "-" for name, info in report["variants"].items()}
    title = f"{ylabel}: one attention layer, hidden {s['hidden']}, {s['dtype']} {s['mode']}, {s['device']}"
    plot_against_n(report["rows"], styles, key, ylabel, title, path)


def write_report(output_dir: Path, files: dict[str, tuple[str, str | Callable[[Path], None]]]) -> dict[str, Path]:
    """The report writer of every benchmark: each file under ``output_dir`` (made if missing).

    Args:
        output_dir: the folder written to.
        files: key -> (file name, its text, or a function writing it given its path: a plot, a CSV).

    Returns:
        key -> the path written.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for key, (name, content) in files.items():
        paths[key] = output_dir / name
        if callable(content):
            content(paths[key])
        else:
            paths[key].write_text(content)
    return paths


def report_json(report: dict[str, Any], command: str) -> str:
    """The report and its command as the JSON file of a run."""
    return json.dumps({**report, "command": command}, indent=2, default=str)


def write_outputs(report: dict[str, Any], output_dir: Path, command: str) -> dict[str, Path]:
    settings = {k: report["settings"].get(k) for k in SETTINGS_COLUMNS}
    params = {name: json.dumps(info["params"], sort_keys=True) for name, info in report["variants"].items()}
    rows = [{**row, **settings, "params": params[row["variant"]]} for row in report["rows"]]
    return write_report(output_dir, {
        "csv": ("bench.csv", lambda path: write_csv(path, rows, CSV_FIELDS + SETTINGS_COLUMNS + ["params"])),
        "json": ("bench.json", report_json(report, command)),
        "markdown": ("bench.md", render_markdown(report, command)),
        "time_plot": ("time_vs_n.png", lambda path: plot(report, "time_s", "time (s)", path)),
        "memory_plot": ("memory_vs_n.png",
                        lambda path: plot(report, "mem_mb", "peak memory above an idle process (MB)", path)),
    })
