"""What a retrofit writes for reading: the transfer map (a table and a plot of each layer's error before and after
transfer and its swap KL), ``results.md`` (the layouts, their held-out KL and perplexity, the tokens and minutes of each
stage, the ``zoo eval`` rows), and per layout a Hub-ready folder: ``retrofit.json`` and a model card naming
``base_model``, the variant per layer and the transfer map."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from zoo.eval.contestants import hub_id
from zoo.reporting import markdown_table, pyplot, read_jsonl, save_figure


def transfer_table(done: dict) -> str:
    """One row per layer; with the variant's own stage (DSA), its measure before and after too."""
    measure = next((row["measure"] for row in done["layers"] if "measure" in row), None)
    header = ["layer", "error before", "error after", "after / before",
              *([f"{measure} before", f"{measure} after"] if measure else []), "swap KL", "trained parameters",
              "seconds"]
    rows = []
    for row in done["layers"]:
        ratio = row["error_after"] / row["error_before"] if row["error_before"] else float("nan")
        measured = [f"{row['measure_before']:.4g}", f"{row['measure_after']:.4g}"] if measure else []
        rows.append([row["layer"], f"{row['error_before']:.3g}", f"{row['error_after']:.3g}", f"{ratio:.3f}",
                     *measured, f"{row['swap_kl']:.4f}", f"{row['trained_parameters']:,}", f"{row['seconds']:.0f}"])
    return "\n".join(markdown_table(header, rows, "r" * len(header)))


def write_transfer_map(done: dict, folder: Path) -> None:
    """``transfer_map.md`` and ``transfer_map.png`` beside ``transfer_map.json``."""
    seconds = done["seconds"]
    head = (f"# Transfer map: {done['variant']['variant']} {done['variant']['params']}\n\n"
            f"Normalized output error (MSE / teacher variance) on {done['held_out_tokens']:,} held-out tokens, "
            f"before and after transfer; swap KL: mean per-token KL of the next-token distribution from the "
            f"original's with only that layer converted (original held-out perplexity "
            f"{done['original_held_out_perplexity']:.2f}). Transfer tokens {done['tokens']:,}; capture "
            f"{seconds['capture']:.0f} s, transfer {seconds['transfer']:.0f} s, swap KL {seconds['swap_kl']:.0f} s on "
            f"{done['threads']} threads; peak RSS {done['peak_rss_mb']:.0f} MB; activations on disk "
            f"{done['activations_disk_bytes'] / 2**20:.0f} MB.\n\n")
    if "stage" in done:
        head += (
            f"Stage 1 ran each layer as {done['stage']['params']} and trained the variant's weights by the "
            f"measure in the table (held out, before and after); the errors are those of the layer as saved.\n\n"
        )
    (folder / "transfer_map.md").write_text(head + transfer_table(done) + "\n")
    plot_transfer_map(done, folder / "transfer_map.png")


def plot_transfer_map(done: dict, path: Path) -> None:
    layers = [row["layer"] for row in done["layers"]]
    figure, (top, bottom) = pyplot().subplots(2, 1, figsize=(8, 5.5), sharex=True)
    top.semilogy(layers, [row["error_before"] for row in done["layers"]], "o-", label="before transfer")
    top.semilogy(layers, [row["error_after"] for row in done["layers"]], "o-", label="after transfer")
    top.set_ylabel("normalized output error")
    top.legend()
    bottom.bar(layers, [row["swap_kl"] for row in done["layers"]], color="tab:red")
    bottom.set_ylabel("swap KL (nats / token)")
    bottom.set_xlabel("layer")
    top.set_title(f"{done['variant']['variant']}: attention transfer per layer")
    save_figure(figure, path, dpi=110)


def eval_rows(summary: dict, out: Path) -> list[dict]:
    """The ``zoo eval`` headline rows of the run in ``out`` (none without an eval)."""
    folder = summary.get("eval_folder")
    path = out / folder / "results.json" if folder else None
    if path is None or not path.is_file():
        return []
    return json.loads(path.read_text())["headline"]


def layouts_table(summary: dict) -> str:
    header = ["layout", "full-attention layers", "converted", "held-out KL / ppl, stage 1", "stage 2",
              "stage 1 tokens", "stage 2 tokens", "stage 2 min"]
    rows = []
    for record in summary["layouts"]:
        one, two = record["stage1"], record.get("stage2") or {}
        after = f"{two['held_out_kl']:.3f} / {two['held_out_perplexity']:.2f}" if "held_out_kl" in two else "–"
        tokens = f"{two['tokens']:,}" if two.get("tokens") else "–"
        minutes = f"{two['seconds'] / 60:.1f}" if two.get("seconds") else "–"
        rows.append([record["name"], record["kept_full"], len(record["converted"]),
                     f"{one['held_out_kl']:.3f} / {one['held_out_perplexity']:.2f}", after, f"{one['tokens']:,}",
                     tokens, minutes])
    return "\n".join(markdown_table(header, rows, "ll" + "r" * 6))


def eval_table(rows: list[dict]) -> str:
    if not rows:
        return "(no zoo eval in this run)"
    lengths = sorted({int(k[4:]) for row in rows for k in row if k.startswith("avg_")})
    header = ["contestant", *[f"avg {n}" for n in lengths], "score [95% CI]", "cache bytes"]
    cells = [[row["contestant"], *[f"{row[f'avg_{n}']:.2f}" if row.get(f"avg_{n}") is not None else "–"
                                   for n in lengths],
              f"{row['score']:.2f} [{row['low']:.2f}, {row['high']:.2f}]",
              f"{row['cache_bytes']:,}" if row.get("cache_bytes") else "–"] for row in rows]
    return "\n".join(markdown_table(header, cells, "l" + "r" * (len(header) - 1)))


def stage2_curve(record: dict, out: Path) -> list[tuple[int, float]]:
    """``(tokens, validation perplexity)`` of a layout's stage 2 in the run folder ``out``, from its training log
    (the log's last evaluation is the final one on the test split, left out)."""
    folder = (record.get("stage2") or {}).get("folder")
    rows = read_jsonl(out / folder / "train_log.jsonl") if folder else []
    evaluations = [row for row in rows if "eval_perplexity" in row][:-1]
    return [(int(row["num_input_tokens_seen"]), float(row["eval_perplexity"])) for row in evaluations]


def plot_stage2_curves(summary: dict, path: Path) -> bool:
    """Validation perplexity against stage-2 tokens, one line per layout; False when no layout has a curve."""
    curves = {record["name"]: stage2_curve(record, path.parent) for record in summary["layouts"]}
    if not any(len(curve) > 1 for curve in curves.values()):
        return False
    figure, axes = pyplot().subplots(figsize=(7, 4))
    for name, curve in curves.items():
        if curve:
            axes.plot([t for t, _ in curve], [p for _, p in curve], "o-", label=name)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("stage-2 tokens")
    axes.set_ylabel("validation perplexity")
    axes.set_title(f"{summary['variant']['variant']}: stage 2 (original: "
                   f"{summary['stage1']['original_held_out_perplexity']:.1f} on the held-out windows)")
    axes.legend()
    save_figure(figure, path, dpi=110)
    return True


def stage_minutes(summary: dict) -> str:
    """The minutes each stage took when it ran, and this invocation's (finished stages are read back)."""
    one = sum(summary["stage1"]["seconds"].values()) / 60
    two = sum((record.get("stage2") or {}).get("seconds") or 0 for record in summary["layouts"]) / 60
    return (f"Stage 1: {one:.1f} min; stage 2: {two:.1f} min over {len(summary['layouts'])} layouts; this "
            f"invocation (finished stages read back): {summary['seconds'] / 60:.1f} min.")


def write_summary(summary: dict, out: Path) -> None:
    done = summary["stage1"]
    curves = "![stage 2](stage2_curves.png)\n\n" if plot_stage2_curves(summary, out / "stage2_curves.png") else ""
    text = (f"# Retrofit of {summary['base_model']} with {summary['variant']['variant']}\n\n"
            f"{stage_minutes(summary)}\n\n## Layouts\n\n{layouts_table(summary)}\n\n{curves}"
            f"## zoo eval\n\n{eval_table(eval_rows(summary, out))}\n\n## Transfer map\n\n{transfer_table(done)}\n")
    (out / "results.md").write_text(text)


def write_model_folder(summary: dict, record: dict, out: Path) -> None:
    """``retrofit.json`` and ``README.md`` (the card) in the layout's final model folder (paths relative to the run
    folder ``out``)."""
    folder = out / record["model_folder"]
    own = {"base_model": summary["base_model"], "variant": summary["variant"], "layout": record,
           "transfer_map": summary["stage1"]}
    (folder / "retrofit.json").write_text(json.dumps(own, indent=2, default=str) + "\n")
    name = f"retrofit {record['name']}"
    rows = [row for row in eval_rows(summary, out) if row["contestant"] == name
            or (row.get("source", "zoo") == "zoo" and row.get("family") == "full")]
    tags = ["attention-zoo", "retrofit", summary["variant"]["variant"]]
    data = ModelCardData(base_model=hub_id(summary["base_model"]), library_name="transformers",
                         pipeline_tag="text-generation", tags=tags)
    body = (f"# {folder.name}: {summary['base_model']} retrofitted with `{summary['variant']['variant']}`\n\n"
            f"Full attention (sdpa) in layers {record['kept_full']}; `{summary['variant']['variant']}` "
            f"{summary['variant']['params']} in the other {len(record['converted'])}. Made with attention-zoo's "
            "retrofit recipe: attention transfer per layer (stage 1"
            + (", then fine-tuning with distillation, stage 2" if record.get("stage2") else "") + ").\n\n"
            "```python\nimport zoo, transformers\n"
            f"model = transformers.AutoModelForCausalLM.from_pretrained({record['model_folder']!r})  "
            "# in the run folder; or this folder's Hub id\n```\n\n"
            f"## Layout\n\n{layouts_table({**summary, 'layouts': [record]})}\n\n"
            f"## zoo eval\n\n{eval_table(rows)}\n\n## Transfer map\n\n{transfer_table(summary['stage1'])}\n")
    ModelCard(f"---\n{data.to_yaml()}\n---\n{body}").save(folder / "README.md")


def describe(summary: dict[str, Any]) -> str:
    """One line per layout for the console."""
    return "\n".join(f"{r['name']}: full attention in {len(r['kept_full'])} layers, held-out KL "
                     f"{r['stage1']['held_out_kl']:.3f}, ppl {r['stage1']['held_out_perplexity']:.2f} -> "
                     f"{r['model_folder']}" for r in summary["layouts"])
