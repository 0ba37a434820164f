"""What a task's kind decides, said once (:data:`KINDS`, looked up with :func:`kind_of`): the model class, how examples
are prepared, the collator, the metrics and logits preprocessing, what results.json records, the headline metric, and
the comparison report's tables and plots. The fine-tune (:mod:`zoo.training.finetune`) and the comparison
(:mod:`zoo.training.compare`) read the record instead of testing the kind's name.

* ``classification`` (listops, brown, gutenberg, hub): a sequence classifier on truncated documents;
* ``lm`` (gutenberg_lm, brown_lm): a causal LM on documents cut into chunks (:mod:`zoo.training.lm`);
* ``recall`` (mqar, passkey): a causal LM scored on its answer tokens (:mod:`zoo.training.recall`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    DataCollatorForLanguageModeling,
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
)

from zoo import data as tasks
from zoo.data.lm import chunk_documents
from zoo.reporting import fixed, markdown_table, save_figure
from zoo.training import lm, recall
from zoo.training.config import FinetuneConfig
from zoo.training.results import MetricComputer, classification_outcome, lm_outcome


@dataclass(frozen=True)
class TaskKind:
    name: str
    model_class: type
    headline: tuple[str, str]  # results.json metric and its label (accuracy: higher is better; perplexity: lower)
    prepare: Callable[[FinetuneConfig, Any, Any], Any]  # (cfg, splits, tokenizer) -> examples with input_ids
    collator: Callable[[Any], Any]  # tokenizer -> data collator
    metrics: Callable[[FinetuneConfig, Any], Any]  # (cfg, evaluation examples) -> Trainer's compute_metrics
    outcome: Callable[..., dict]  # (cfg, out, computer, metrics, examples, label_names) -> results.json fields
    quality: Callable[[dict], str]  # results.json -> the summary line's quality part
    tables: Callable[[list[dict]], list[str]]  # comparison rows -> markdown lines
    preprocess_logits: Callable | None = None
    labelled: bool = False  # the splits carry a ClassLabel column (the model's num_labels and id2label)
    result_columns: tuple[str, ...] = ()  # results.json keys a comparison row keeps
    summary_fields: Callable[[list[dict]], dict] | None = None  # the seeds' rows -> the summary row's own fields
    plots: tuple[tuple[str, Callable], ...] = ()  # (plot name, fn(plt, task, rows, path)) drawn by the report
    images: tuple[tuple[str, str], ...] = field(default=())  # (alt text, plot name) the markdown report shows
    trains_tokenizer: bool = False  # from scratch: a BPE tokenizer trained on the training split (zoo.data.lm)

    @property
    def causal_lm(self) -> bool:
        return self.model_class is AutoModelForCausalLM


def take_subsets(cfg: FinetuneConfig, dataset):
    """``max_train_examples`` / ``max_eval_examples`` of each split (the same evaluation examples for every seed)."""
    for split in dataset:
        limit = cfg.max_train_examples if split == "train" else cfg.max_eval_examples
        if limit is not None and limit < len(dataset[split]):
            seed = cfg.seed if split == "train" else 0
            dataset[split] = dataset[split].shuffle(seed=seed).select(range(limit))
    return dataset


def tokenize(dataset, tokenizer, max_length: int):
    def encode(batch):
        return tokenizer(batch["text"], truncation=True, max_length=max_length)

    drop = [c for c in dataset["train"].column_names if c != "label"]
    return dataset.map(encode, batched=True, remove_columns=drop, desc="tokenizing")


def params_text(row: dict) -> str:
    return recall.params_text(row["variant_params"])


def mean_std(row: dict, key: str) -> str:
    """``mean ± std`` over several seeds; with one seed no ± (there is no spread to show)."""
    return recall.accuracy_cell(row[key], row[f"{key}_std"], row.get("seeds_ok", 1))


# ---------------------------------------------------------------------------------------------------
# classification


def classification_table(rows: list[dict]) -> list[str]:
    header = ["variant", "params", "max_length", "accuracy", "macro-F1", "train tok/s", "eval tok/s", "peak MB",
              "wall s", "status"]  # fmt: skip
    speeds = ("train_tokens_per_second", "eval_tokens_per_second", "peak_memory_mb", "wall_time_seconds")
    table = [
        [r["name"], params_text(r), r["max_length"], mean_std(r, "eval_accuracy"), mean_std(r, "eval_macro_f1"),
         *(fixed(r[key], 0, grouping=True) for key in speeds), r["status"]]
        for r in rows
    ]  # fmt: skip
    return markdown_table(header, table, align="llrrrrrrrl")


CLASSIFICATION = TaskKind(
    name="classification",
    model_class=AutoModelForSequenceClassification,
    headline=("eval_accuracy", "accuracy"),
    prepare=lambda cfg, splits, tokenizer: tokenize(take_subsets(cfg, splits), tokenizer, cfg.max_length),
    collator=DataCollatorWithPadding,
    metrics=lambda cfg, examples: MetricComputer(),
    outcome=lambda cfg, out, computer, metrics, examples, labels: classification_outcome(out, computer, metrics,
                                                                                         labels),
    quality=lambda r: f"accuracy {r['metrics']['eval_accuracy']:.4f}  macro-F1 {r['metrics']['eval_macro_f1']:.4f}",
    tables=classification_table,
    labelled=True,
)


# ---------------------------------------------------------------------------------------------------
# language modelling


def lm_tables(rows: list[dict]) -> list[str]:
    """The main table (loss, perplexity, speeds, memory) and the loss-by-position table (one column per bucket)."""
    header = ["variant", "params", "max_length", "eval loss", "perplexity", "train tok/s", "decode tok/s",
              "peak MB", "wall s", "status"]  # fmt: skip
    speeds = ("train_tokens_per_second", "decode_tokens_per_second", "peak_memory_mb", "wall_time_seconds")
    table = [
        [r["name"], params_text(r), r["max_length"], mean_std(r, "eval_loss"), fixed(r["eval_perplexity"], 1),
         *(fixed(r[key], 0, grouping=True) for key in speeds), r["status"]]
        for r in rows
    ]  # fmt: skip
    lines = markdown_table(header, table, align="llrrrrrrrl")
    buckets = max((r["loss_by_position"] or [] for r in rows), key=len)
    if buckets:
        lines += ["", "Mean eval loss by token position (a token at position p is predicted from the p tokens of its "
                  "own document before it; lower late buckets = far context used):", ""]  # fmt: skip
        table = []
        for r in rows:
            losses = {b["bucket"]: b["loss"] for b in r["loss_by_position"] or []}
            table.append([r["name"], *(fixed(losses.get(b["bucket"]), 3) for b in buckets)])
        lines += markdown_table(["variant", *(b["bucket"] for b in buckets)], table, align="l" + "r" * len(buckets))
    return lines


def plot_loss_by_position(plt, task: str, rows: list[dict], path: Path) -> None:
    """Mean eval loss per position bucket, one line per variant (x: bucket, log-spaced positions)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ticks = {}
    for r in rows:
        buckets = [b for b in r["loss_by_position"] or [] if b["loss"] is not None]
        if buckets:
            middle = [(max(b["start"], 1) * b["end"]) ** 0.5 for b in buckets]  # geometric middle of the bucket
            ticks.update(zip(middle, (b["bucket"] for b in buckets), strict=True))
            ax.plot(middle, [b["loss"] for b in buckets], marker="o", label=f"{r['name']} ({r['max_length']})")
    ax.set_xscale("log")
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.minorticks_off()
    ax.set(xlabel="token position in the chunk", ylabel="mean eval loss (nats)")
    ax.set_title(f"{task}: loss by token position")
    if ax.lines:
        ax.legend(fontsize=8)
    save_figure(fig, path)


def lm_quality(results: dict) -> str:
    decode = results["decode_tokens_per_second"] or 0
    return f"perplexity {results['metrics']['eval_perplexity']:.2f}  decode {decode:.0f} tok/s"


LANGUAGE_MODELLING = TaskKind(
    name="lm",
    model_class=AutoModelForCausalLM,
    headline=("eval_perplexity", "perplexity"),
    prepare=lambda cfg, splits, tokenizer: take_subsets(
        cfg, chunk_documents(splits, tokenizer, cfg.max_length, cfg.min_chunk_length)),
    collator=lambda tokenizer: DataCollatorForLanguageModeling(tokenizer, mlm=False),
    metrics=lambda cfg, examples: lm.PositionLoss(cfg.max_length),
    outcome=lambda cfg, out, computer, metrics, examples, labels: lm_outcome(cfg, out, computer, metrics, examples),
    quality=lm_quality,
    tables=lm_tables,
    preprocess_logits=lm.per_token_loss,
    plots=(("loss_by_position", plot_loss_by_position),),
    images=(("loss by position", "loss_by_position"),),
    trains_tokenizer=True,
)


# ---------------------------------------------------------------------------------------------------
# recall

RECALL = TaskKind(
    name="recall",
    model_class=AutoModelForCausalLM,
    headline=("eval_accuracy", "accuracy"),
    prepare=lambda cfg, splits, tokenizer: take_subsets(cfg, splits),  # token ids and answer labels already
    collator=DataCollatorForSeq2Seq,
    metrics=lambda cfg, examples: recall.RecallAccuracy(examples),
    outcome=lambda cfg, out, computer, metrics, examples, labels: recall.outcome(out, computer, metrics,
                                                                                 examples[cfg.eval_split]),
    quality=lambda r: f"accuracy {r['metrics']['eval_accuracy']:.4f} (answer tokens)",
    tables=recall.report_tables,
    preprocess_logits=recall.predicted_tokens,
    result_columns=("decoding_state_bytes", "majority_accuracy", "guess_accuracy", "answers", "accuracy_by_distance"),
    summary_fields=recall.summary_fields,
    plots=(("frontier", recall.plot_frontier), ("accuracy_by_distance", recall.plot_by_distance)),
    images=(("recall vs decoding state", "frontier"), ("accuracy by distance", "accuracy_by_distance")),
)

KINDS = {kind.name: kind for kind in (CLASSIFICATION, LANGUAGE_MODELLING, RECALL)}


def kind_of(task: str) -> TaskKind:
    """The kind of a task (``zoo.data``'s ``Task.kind``)."""
    return KINDS[tasks.get_task(task).kind]
