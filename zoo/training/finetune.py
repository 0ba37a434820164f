"""Fine-tune a sequence classifier, or train a causal language model, with an attention-zoo variant on long documents.

``python recipes/finetune.py CONFIG.yaml [--key value ...]`` (settings: :class:`~zoo.training.config.FinetuneConfig`),
also under ``accelerate launch``: training is transformers' ``Trainer``. The task decides the kind of run
(classification or language modelling); the output folder is locked for the run and resumes are exact or refused.

Tasks, outputs and what each module handles: docs/notes/training.md#finetune
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
from pathlib import Path
from typing import Any

import transformers
from transformers import (
    AutoConfig,
    AutoTokenizer,
    TrainingArguments,
)

from zoo import data as tasks
from zoo.convert.longify import check_max_length, longify, position_capacity
from zoo.data.lm import bpe_tokenizer
from zoo.plug.install import configure_variant
from zoo.plug.spec import IMPLEMENTATION
from zoo.training import distributed
from zoo.training.config import (
    FinetuneConfig,
    ResolvedRun,
    check_config,
    parse_config,
    resolve,
    resolve_pretrained,
)
from zoo.training.distill import DistillingTrainer, load_teacher, merge_lora, select_trainable
from zoo.training.kinds import KINDS, TaskKind, kind_of
from zoo.training.results import (
    JsonlLog,
    Throughput,
    peak_memory_mb,
    publish,
    results_record,
)
from zoo.training.run_folder import ResumePlan, lock_output_dir, resume_plan
from zoo.training.trainer import Trainer

# Config keys that hold attention dropout, by model family (BERT/RoBERTa, Llama/ModernBERT/DistilBERT, GPT-2).
ATTENTION_DROPOUT_KEYS = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop")
logger = logging.getLogger("zoo.training.finetune")


# ---------------------------------------------------------------------------------------------------
# data, tokenizer, model


def load_splits(cfg: FinetuneConfig, kind: TaskKind) -> tuple[Any, list[str] | None]:
    """The task's splits (whole documents or examples; subsets are taken by ``kind.prepare``) and label names."""
    dataset = tasks.build_task(cfg.task, **cfg.task_options)
    for split in ("train", cfg.eval_split):
        if split not in dataset:
            raise ValueError(f"task {cfg.task!r} has no split {split!r}; its splits: {', '.join(dataset)}.")
    return dataset, dataset["train"].features["label"].names if kind.labelled else None


def load_tokenizer(run: ResolvedRun, kind: TaskKind, model_path: str | None, dataset):
    cfg = run.cfg
    source = cfg.tokenizer_name_or_path or model_path
    if source is not None:
        tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained(source)[0])
        if kind.causal_lm and tokenizer.pad_token is None:  # Llama / GPT-2 tokenizers: pad with EOS
            tokenizer.pad_token = tokenizer.eos_token
    elif kind.trains_tokenizer:
        tokenizer = bpe_tokenizer(dataset["train"]["text"], cfg.tokenizer_vocab_size)
    elif run.task.tokenizer is not None:
        tokenizer = tasks.task_tokenizer(cfg.task, cfg.task_options)
    else:
        raise ValueError(
            f"task {cfg.task!r} has no vocabulary of its own: set tokenizer_name_or_path (e.g. 'minilm') to train "
            "a model from scratch on it."
        )
    tokenizer.model_max_length = cfg.max_length
    return tokenizer


def model_config(run: ResolvedRun, model_path: str | None, tokenizer, label_names: list[str] | None):
    cfg = run.cfg
    labels = {}
    if label_names is not None:
        labels = {"num_labels": len(label_names), "id2label": dict(enumerate(label_names))}
        labels["label2id"] = {name: i for i, name in enumerate(label_names)}
    if model_path is not None:
        config = AutoConfig.from_pretrained(model_path, **labels)
    else:
        options = dict(cfg.model_config)
        model_type = options.pop("model_type", None)
        if model_type is None:
            raise ValueError("model_config needs a model_type (e.g. bert, modernbert, llama).")
        options.setdefault("vocab_size", len(tokenizer))
        options.setdefault("max_position_embeddings", cfg.max_length)
        roles = ("pad", "bos", "eos") if label_names is None else ("pad", "bos", "eos", "cls", "sep")
        options = {**special_token_ids(tokenizer, roles), **options}
        config = AutoConfig.for_model(model_type, **options, **labels)
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    if cfg.attention_dropout is not None:
        for key in ATTENTION_DROPOUT_KEYS:
            if hasattr(config, key):
                setattr(config, key, cfg.attention_dropout)
    return configure_variant(config, run.variant, cfg.variant)


def special_token_ids(tokenizer, roles: tuple[str, ...]) -> dict[str, int]:
    """pad / bos / eos / cls / sep ids of a tokenizer, for a config built from scratch on its vocabulary.

    Config defaults point into the family's own vocabulary (ModernBERT's pad id is 50283), which would be out
    of range for a small task vocabulary such as ListOps'.
    """
    ids = {}
    for role in roles:
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        ids[f"{role}_token_id"] = token_id if token_id is not None else tokenizer.pad_token_id
    return ids


def build_model(run: ResolvedRun, kind: TaskKind, model_path: str | None, tokenizer,
                label_names: list[str] | None):
    cfg = run.cfg
    config = model_config(run, model_path, tokenizer, label_names)
    transformers.set_seed(cfg.seed)  # from-scratch weights and the new classifier head
    if model_path is not None:
        model = kind.model_class.from_pretrained(model_path, config=config)
    else:
        model = kind.model_class.from_config(config)
    if kind.causal_lm:
        # Causal-LM losses take num_items_in_batch (tokens over all processes and accumulation steps), as Trainer
        # expects; the cache is of no use while training and evaluating on whole chunks (restored before saving).
        model.config.use_cache = False
    else:
        # The classification heads average their loss over the batch themselves. Left to its signature check
        # (forward takes **kwargs), Trainer would assume a summed loss: it would multiply it by the number of
        # processes and skip the division by gradient_accumulation_steps.
        model.accepts_loss_kwargs = False
    if model.config._attn_implementation != IMPLEMENTATION:
        model.set_attn_implementation(IMPLEMENTATION)
    if cfg.longify and cfg.max_length > position_capacity(model):
        longify(model, cfg.max_length)
    check_max_length(model, cfg.max_length)
    return model


# ---------------------------------------------------------------------------------------------------
# training


def find_unused_parameters(cfg: FinetuneConfig | ResolvedRun) -> bool:
    """Whether DDP must look for parameters without a gradient each step: only for a variant that leaves some unused
    by design (``Variant.trains_every_parameter``); the search costs a graph traversal per step, and without it such
    a variant fails at its second step ("Expected to have finished reduction in the prior iteration")."""
    variant = cfg.variant if isinstance(cfg, ResolvedRun) else resolve(cfg).variant
    return not variant.trains_every_parameter  # a hybrid: its layers'


def training_arguments(cfg: FinetuneConfig, run: ResolvedRun | None = None) -> TrainingArguments:
    """transformers' TrainingArguments of the fine-tune (``run``: its resolved variant, else resolved here)."""
    own = {f.name for f in dataclasses.fields(TrainingArguments)}
    shared = {k: v for k, v in dataclasses.asdict(cfg).items() if k in own}
    for key in ("push_to_hub", "resume_from_checkpoint", "training_args"):  # handled by the recipe itself
        shared.pop(key, None)
    extra = dict(cfg.training_args)
    unknown = sorted(set(extra) - own)
    if unknown:
        raise ValueError(f"training_args: {unknown[0]!r} is not a transformers TrainingArguments key.")
    defaults = {
        "use_cpu": not distributed.accelerator_available(),
        "ddp_find_unused_parameters": find_unused_parameters(run or cfg),
    }
    return TrainingArguments(
        **{**defaults, **shared, **extra},
        report_to="none",
        include_num_input_tokens_seen="non_padding",
        eval_do_concat_batches=True,
    )


def run(cfg: FinetuneConfig) -> dict | None:
    """Run one fine-tune; returns the results record on the main process (None elsewhere, and for a finished run)."""
    started = time.perf_counter()
    resolved = check_config(cfg)
    lock = lock_output_dir(cfg)
    try:
        plan = resume_plan(cfg, resolved.variant)
        if plan.finished_at is not None:
            return None
        return train(resolved, plan, started)
    finally:
        lock.release()


def train(run: ResolvedRun, plan: ResumePlan, started: float) -> dict | None:
    """Data, model, training, final evaluation and results (:func:`run` has resolved and checked the config and
    locked the folder)."""
    cfg = run.cfg
    args = training_arguments(cfg, run)
    model_path, base_model = resolve_pretrained(cfg.model_name_or_path) if cfg.model_name_or_path else (None, None)
    kind = KINDS[run.task.kind]
    with args.main_process_first(desc="building the dataset"):
        dataset, label_names = load_splits(cfg, kind)
        tokenizer = load_tokenizer(run, kind, model_path, dataset)
        examples = kind.prepare(cfg, dataset, tokenizer)
    model = build_model(run, kind, plan.weights or model_path, tokenizer, label_names)  # weights only: the checkpoint's
    select_trainable(model, cfg.trainable, cfg.lora)
    computer, collator = kind.metrics(cfg, examples[cfg.eval_split]), kind.collator(tokenizer)
    throughput, parameter_count = Throughput(), distributed.ParameterCount()
    trainer_class, distill = Trainer, {}
    if cfg.distill_from:
        trainer_class = DistillingTrainer
        distill = {"teacher": load_teacher(resolve_pretrained(cfg.distill_from)[0], model),
                   "weight": cfg.distill_weight, "temperature": cfg.distill_temperature}
    trainer = trainer_class(
        **distill,
        model=model,
        args=args,
        train_dataset=examples["train"],
        eval_dataset=examples["validation"] if "validation" in examples else None,
        data_collator=collator,
        processing_class=tokenizer,
        compute_metrics=computer,
        preprocess_logits_for_metrics=kind.preprocess_logits,
        callbacks=[JsonlLog(), throughput, parameter_count],
    )
    trainer.train(resume_from_checkpoint=plan.checkpoint)
    metrics = trainer.evaluate(examples[cfg.eval_split], metric_key_prefix="eval")
    validation = evaluate_validation(cfg, kind, trainer, examples)
    eval_tokens = sum(len(ids) for ids in examples[cfg.eval_split]["input_ids"])
    speeds = {
        "train_tokens_per_second": float(throughput.tokens_per_second),
        "eval_tokens_per_second": eval_tokens / max(metrics["eval_runtime"], 1e-9),
        "peak_memory_mb": peak_memory_mb(trainer),
    }
    launch = distributed.describe(trainer, parameter_count)
    if kind.causal_lm:
        model.config.use_cache = True  # saved for generation
    if cfg.lora:
        merge_lora(trainer.model)
    trainer.save_model(cfg.output_dir)
    trainer.save_state()
    results = None
    if trainer.is_world_process_zero():
        out = Path(cfg.output_dir)
        outcome = kind.outcome(cfg, out, computer, metrics, examples, label_names)
        speeds["wall_time_seconds"] = time.perf_counter() - started
        results = results_record(cfg, model, examples, outcome, speeds, launch, base_model)
        results["training_curves"] = trainer.logged_curves()  # indexer_kl, distill_kl: [[step, mean], ...]
        if validation is not None:
            results["validation_metrics"] = validation
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        publish(cfg, out)
    close_process_group(trainer)
    return results


def evaluate_validation(cfg: FinetuneConfig, kind: TaskKind, trainer, examples) -> dict | None:
    """With ``evaluate_validation``: the validation split's metrics (``validation_accuracy``, ``validation_loss``,
    ...), with a metric computer of its own (the evaluation split's keeps its state for results.json). A comparison
    chooses learning rates on them, never on the evaluation (test) split. None without the key or the split."""
    if not cfg.evaluate_validation or "validation" not in examples or cfg.eval_split == "validation":
        return None
    computer = trainer.compute_metrics
    trainer.compute_metrics = kind.metrics(cfg, examples["validation"])
    try:
        metrics = trainer.evaluate(examples["validation"], metric_key_prefix="validation")
    finally:
        trainer.compute_metrics = computer
    return {key: float(value) for key, value in metrics.items() if isinstance(value, int | float)}


def close_process_group(trainer: Trainer) -> None:
    """Leave together, free the DistributedDataParallel wrapper, then destroy the process group.

    Left to interpreter shutdown, a gloo group can abort the process ("terminate called without an active
    exception"), so the launcher reports a finished run as failed. Destroying the group while DDP still holds
    it is no better: the wrapper, freed later, drops the group's last reference and its destructor waits on
    worker threads that wait for the GIL (a deadlock). Hence this order.
    """
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    trainer.model_wrapped = trainer.model
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


def main(argv: list[str] | None = None) -> None:
    results = run(parse_config(argv))
    if results is not None:
        quality = kind_of(results["task"]).quality(results)
        print(
            f"[{results['task']} / {results['variant']}] {quality}  train {results['train_tokens_per_second']:.0f} "
            f"tok/s  peak {results['peak_memory_mb']:.0f} MB  ({results['num_processes']} process(es), "
            f"{results['distributed_type']}) -> {results['config']['output_dir']}"
        )


if __name__ == "__main__":
    main()
