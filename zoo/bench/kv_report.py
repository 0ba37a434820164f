"""The report of the KV-cache benchmark (:mod:`zoo.bench.kv`): ``kv.md`` (per context and kept fraction the
summary, per contestant and depth the keys found, then the peak-RSS and decode-time rows) and ``kv.png`` (keys found
against cache bytes), from the rows in ``accuracy.jsonl``, ``kvpress.jsonl``, ``memory.jsonl`` and
``decode.jsonl``.
"""

from __future__ import annotations

from pathlib import Path

from zoo.bench.passkey import NEW_TOKENS
from zoo.bench.report import write_report
from zoo.reporting import markdown_table, pyplot, read_jsonl, save_figure


def accuracy_rows(out: Path) -> list[dict]:
    """The measured accuracy rows, the zoo's and kvpress's, each contestant once (its first row)."""
    rows = [r for r in read_jsonl(out / "accuracy.jsonl") if "found" in r]
    for row in read_jsonl(out / "kvpress.jsonl"):
        if "found" in row:
            rows.append({**row, "family": "kvpress"})
    unique = {}  # a contestant measured twice (two runs appending) is listed once, its first row
    for row in rows:
        unique.setdefault((row["family"], row["name"], row["budget"], row["context"], row.get("chunk")), row)
    return list(unique.values())


def _kept(r: dict) -> str:
    if r["family"] == "full" or (r["family"] == "kvpress" and r["name"] == "no press"):
        return "100%"
    return f"{r['nbits']}-bit" if r["family"] == "quantized" else f"{r['budget']:.0%}"


def _mb(value: float | None) -> str:
    return "–" if value is None else f"{value / 2**20:.0f}"


def _label(r: dict) -> str:
    return r["name"] if r["family"] != "kvpress" else f"kvpress {r['name']}"


def _summary(rows: list[dict]) -> list[str]:
    """Per context and kept fraction: the zoo's best policy, kvpress's best press, the window, QuantizedCache."""
    def best(group: list[dict]) -> str:
        if not group:
            return "–"
        top = max(sum(r["found"]) for r in group)
        names = sorted(r["name"].removeprefix("budget ") for r in group if sum(r["found"]) == top)
        return f"{top}/{len(group[0]['found'])} ({', '.join(names)})"

    def each(group: list[dict]) -> str:
        return ", ".join(f"{r['name'].removeprefix('budget ')} {sum(r['found'])}" for r in
                         sorted(group, key=lambda r: r["name"])) or "–"

    table = []
    for context in sorted({r["context"] for r in rows}):
        here = [r for r in rows if r["context"] == context]
        for budget in sorted({r["budget"] for r in here if r["family"] in ("budget", "kvpress", "longformer")
                              and r["budget"] < 1}, reverse=True):
            at = [r for r in here if r["budget"] == budget]
            zoo, press = [r for r in at if r["family"] == "budget"], [r for r in at if r["family"] == "kvpress"]
            window = [r for r in at if r["family"] == "longformer"]
            table.append([context, f"{budget:.0%}", best(zoo), best(press),
                          best(window).split(" (")[0] if window else "–", each(zoo), each(press)])
    header = ["context", "kept", "zoo `budget` best", "kvpress best", "`longformer` + 4 sinks", "all zoo policies",
              "all kvpress presses"]
    return ["## Summary: found / prompts, best of each side per kept fraction", "", *markdown_table(header, table),
            ""]


def _context_section(rows: list[dict], context: int) -> list[str]:
    """Every contestant at ``context`` tokens: kept fraction, cache MB per prompt, keys found in all and per depth."""
    here = [r for r in rows if r["context"] == context]
    depths = sorted({d for r in here for d in r["depths"]})
    counts = sorted({len(r["found"]) for r in here})
    table = []
    for r in sorted(here, key=lambda r: (-r["budget"] if r["family"] != "quantized" else -2,
                                         r["family"] != "full", r["family"], r["name"])):
        per_depth = []
        for d in depths:
            hits = [f for f, dd in zip(r["found"], r["depths"], strict=True) if dd == d]
            per_depth.append(f"{sum(hits)}/{len(hits)}" if hits else "–")
        mb = r.get("per_prompt_bytes")
        table.append([_label(r), _kept(r), "–" if mb is None else f"{mb / 2**20:.1f}",
                      f"{sum(r['found'])}/{len(r['found'])}", *per_depth])
    header = ["contestant", "kept", "cache MB / prompt", "found", *(f"d={d:g}" for d in depths)]
    return [f"## {context} tokens ({'/'.join(map(str, counts))} prompts: depths "
            f"{', '.join(f'{d:g}' for d in depths)})", "", *markdown_table(header, table), ""]


def _memory_section(memory: list[dict]) -> list[str]:
    table = []
    for r in memory:
        peak = max(r["prefill_peak_rss_bytes"] or 0, r["decode_peak_rss_bytes"] or 0)
        allocator = ", ".join(r.get("env") or []) + (" malloc_trim per layer" if r.get("trim") else "")
        table.append([r["contestant"]["name"], r["context"], r["chunk"] or "no", r.get("code", "this commit"),
                      allocator or "glibc default", r["tokens_kept"] or "all", f"{r['cache_bytes'] / 2**20:.1f}",
                      _mb(r["model_rss_bytes"]), _mb(r["start_rss_bytes"]), _mb(r["prefill_peak_rss_bytes"]),
                      _mb(r["decode_peak_rss_bytes"]), _mb(peak - r["start_rss_bytes"]),
                      f"{r['ms_per_token']:.0f}" if r.get("ms_per_token") else "–"])
    header = ["contestant", "context", "chunked prefill", "zoo code", "allocator", "keys kept", "cache MB", "loaded",
              "before", "peak prefill", "peak decode", "peak above before", "ms / token"]
    return ["## Peak RSS (one fresh process per row; batch 1, key at depth 0.5, 16 new tokens)", "",
            "MB. *loaded*: after `from_pretrained` (the weights are a memory map of the safetensors file, "
            "mostly not yet read); *before*: after a 256-token warm-up `generate` (every weight page read: "
            "the model's real footprint), the baseline; *above*: the measured call's peak minus *before*.", "",
            *markdown_table(header, table), ""]


def _decode_section(decode: list[dict]) -> list[str]:
    table = [[r["context"], r["name"], f"{r['cache_bytes'] / 2**20:.1f}", f"{r['ms_per_token']:.1f}",
              r["tokens_timed"], f"{r['vs_window']:.2f}x", r["threads"], " / ".join(r["load"] or [])]
             for r in decode]
    header = ["context", "contestant", "cache MB", "ms / token (median)", "tokens timed", "vs window", "threads",
              "load (1/5/15 min)"]
    return ["## Decode time per token, SmolLM2-135M (one process, contestants in interleaved rounds)", "",
            *markdown_table(header, table), ""]


def render_kv_markdown(out: Path) -> str:
    """``kv.md`` from the rows under ``out``."""
    rows = accuracy_rows(out)
    lines = ["# Passkey retrieval with a bounded KV cache: SmolLM2-135M-Instruct", "",
             f"Commands, load and what each number means: results/bench/kv/README.md. {NEW_TOKENS} greedy tokens; "
             "found = the key in them. Cache MB per prompt as held after the last token (QuantizedCache: its "
             "packed data, scales and zero points and the fp32 residual tokens, measured).", ""]
    lines += _summary(rows)
    for context in sorted({r["context"] for r in rows}):
        lines += _context_section(rows, context)
    memory = [r for r in read_jsonl(out / "memory.jsonl") if "error" not in r and r.get("start_rss_bytes")]
    if memory:
        lines += _memory_section(memory)
    decode = [r for r in read_jsonl(out / "decode.jsonl") if r.get("model") == "smollm2-135m"]
    if decode:
        lines += _decode_section(decode)
    return "\n".join(lines)


def plot_found_against_bytes(rows: list[dict], path: Path) -> None:
    """One panel per context: keys found against cache MB per prompt, a line per contestant (kvpress dashed)."""
    plt = pyplot()
    contexts = sorted({r["context"] for r in rows})
    labels = sorted({_label(r) for r in rows if r.get("per_prompt_bytes") is not None})
    colours = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(contexts), figsize=(6.5 * len(contexts) + 3, 4.8), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        groups: dict[str, list] = {}
        for r in rows:
            if r["context"] == context and r.get("per_prompt_bytes") is not None:
                groups.setdefault(_label(r), []).append((r["per_prompt_bytes"] / 2**20,
                                                         sum(r["found"]) / len(r["found"])))
        for label, points in sorted(groups.items()):  # one colour per contestant in every panel
            points.sort()
            peer = label.startswith("kvpress")
            ax.plot(*zip(*points, strict=True), "--" if peer else "-", marker="s" if peer else "o",
                    color=colours(labels.index(label) % 20), label=label)
        ax.set_xscale("log")
        ax.set_xlabel("cache MB per prompt")
        ax.set_ylabel("passkey found")
        ax.set_title(f"SmolLM2-135M, {context}-token passkey")
        ax.grid(alpha=0.3)
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines()}  # every contestant, once
    axes[0][-1].legend([handles[label] for label in labels], labels, fontsize=7, loc="upper left",
                       bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path)


def write_kv_report(out: Path) -> dict[str, Path]:
    """Write ``kv.md`` and ``kv.png`` under ``out``; returns their paths."""
    rows = accuracy_rows(out)
    return write_report(out, {"markdown": ("kv.md", render_kv_markdown(out)),
                              "plot": ("kv.png", lambda path: plot_found_against_bytes(rows, path))})
