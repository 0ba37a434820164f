"""What a finished run leaves behind: metrics, results.json (:func:`results_record`), logs, the model card, the Hub.

Trainer callbacks for the live log (``train_log.jsonl``) and the throughput, the classification metrics, the
language-model outcome (sample and decode speed from the saved folder) and :func:`publish`.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import json
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback

from zoo import data as tasks
from zoo import metrics as zoo_metrics
from zoo.hub.card import write_model_card
from zoo.hub.push import push_folder
from zoo.plug.spec import variant_spec
from zoo.reporting import MB, peak_memory_bytes
from zoo.training import lm
from zoo.training.config import FinetuneConfig
from zoo.training.numerics import numerics_record


class MetricComputer:
    """compute_metrics for Trainer: accuracy and macro-F1 with ``evaluate``; keeps the last predictions.

    Trainer hands it predictions already gathered across processes (each example exactly once).
    """

    def __init__(self) -> None:
        self.accuracy = zoo_metrics.load("accuracy")
        self.f1 = zoo_metrics.load("f1")
        self.predictions: np.ndarray | None = None
        self.labels: np.ndarray | None = None

    def __call__(self, eval_pred) -> dict[str, float]:
        logits = eval_pred.predictions[0] if isinstance(eval_pred.predictions, tuple) else eval_pred.predictions
        self.predictions, self.labels = np.argmax(logits, axis=-1), np.asarray(eval_pred.label_ids)
        accuracy = self.accuracy.compute(predictions=self.predictions, references=self.labels)["accuracy"]
        f1 = self.f1.compute(predictions=self.predictions, references=self.labels, average="macro")["f1"]
        return {"accuracy": accuracy, "macro_f1": f1}


class JsonlLog(TrainerCallback):
    """Append every Trainer log record to ``output_dir/train_log.jsonl`` as it happens (main process)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            with open(Path(args.output_dir) / "train_log.jsonl", "a") as fh:
                fh.write(json.dumps({"step": state.global_step, **logs}) + "\n")


class Throughput(TrainerCallback):
    """Tokens seen (non-padding, all processes) and wall time of this ``train()`` call."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_tokens, self.start_time = state.num_input_tokens_seen, time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        seconds = max(time.perf_counter() - self.start_time, 1e-9)
        self.tokens_per_second = (state.num_input_tokens_seen - self.start_tokens) / seconds


def peak_memory_mb(trainer: Trainer) -> float:
    """Max over processes: CUDA peak allocation on GPU, else the process's peak resident memory."""
    peak = peak_memory_bytes() / MB
    peaks = trainer.accelerator.gather(torch.tensor([float(peak)], device=trainer.accelerator.device))
    return float(peaks.max())


def package_versions() -> dict[str, str]:
    names = ("attention-zoo", "torch", "transformers", "accelerate", "datasets", "evaluate")
    return {name: importlib.metadata.version(name) for name in names}


def results_record(cfg, model, examples, outcome: dict, speeds: dict, launch: dict, base_model) -> dict:
    """results.json: what the model card (:mod:`zoo.hub.card`) and :mod:`zoo.training.compare` read; keep keys stable.

    ``outcome`` is the task kind's part: classification -> num_labels, label_names, metrics (accuracy, macro-F1,
    loss); language modelling -> metrics (token loss, perplexity), loss_by_position, generation.
    """
    spec = variant_spec(model.config)
    return {
        "task": cfg.task,
        "dataset": tasks.task_source(cfg.task, cfg.task_options),
        "variant": spec["variant"],
        "variant_params": spec["params"],
        "variant_package": spec["package"],
        "variant_version": spec["version"],
        "model": cfg.model_name or cfg.model_name_or_path or f"{model.config.model_type} (from scratch)",
        "base_model": base_model,
        "model_type": model.config.model_type,
        "architecture": type(model).__name__,
        "max_length": cfg.max_length,
        "num_processes": launch["world_size"],
        **launch,
        "seed": cfg.seed,
        **outcome,
        **speeds,
        "train_examples": len(examples["train"]),
        "eval_examples": len(examples[cfg.eval_split]),
        "max_steps": cfg.max_steps if cfg.max_steps > 0 else None,
        "num_train_epochs": float(cfg.num_train_epochs),
        "packages": package_versions(),
        "numerics": numerics_record(),
        "config": dataclasses.asdict(cfg),
    }


def classification_outcome(out: Path, computer: MetricComputer, metrics: dict, label_names: list[str]) -> dict:
    """Metrics of a classifier; writes eval_predictions.csv (label and prediction per evaluation example)."""
    with open(out / "eval_predictions.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["label", "prediction"])
        pairs = zip(computer.labels, computer.predictions, strict=True)
        writer.writerows((label_names[label], label_names[prediction]) for label, prediction in pairs)
    return {
        "num_labels": len(label_names),
        "label_names": label_names,
        "metrics": {key: float(metrics[key]) for key in ("eval_accuracy", "eval_macro_f1", "eval_loss")},
    }


def lm_outcome(cfg: FinetuneConfig, out: Path, computer: lm.PositionLoss, metrics: dict, examples) -> dict:
    """Metrics of a language model; the greedy sample and decode speed come from the saved folder, loaded back
    with AutoModelForCausalLM as a user would (sample.json / sample.txt)."""
    token_loss = float(metrics["eval_token_loss"])  # mean over every predicted token (exp: the perplexity)
    outcome = {
        "metrics": {"eval_loss": token_loss, "eval_perplexity": float(metrics["eval_perplexity"])},
        "loss_by_position": computer.by_position,
        "decode_tokens_per_second": None,
        "generation": None,
    }
    if cfg.generate_new_tokens == 0:
        return outcome
    chunk = examples[cfg.eval_split][0]
    prompt = chunk["input_ids"][: cfg.generate_prompt_tokens or cfg.max_length - cfg.generate_new_tokens]
    model = AutoModelForCausalLM.from_pretrained(out)
    sample = lm.generate_sample(model, AutoTokenizer.from_pretrained(out), prompt, cfg.generate_new_tokens)
    lm.write_sample(out, sample, source=f"{cfg.eval_split} split: {chunk['document']} from token {chunk['start']}")
    outcome["decode_tokens_per_second"] = sample["decode_tokens_per_second"]
    keys = ("prompt_tokens", "new_tokens", "prefill_seconds", "decode_tokens_per_second", "threads")
    outcome["generation"] = {key: sample[key] for key in keys} | {"method": lm.DECODE_SPEED_METHOD}
    return outcome


def publish(cfg: FinetuneConfig, out: Path) -> None:
    """Make the folder Hub-ready (model card, no pickle files) and, when asked, push it (zoo.hub.push)."""

    # Trainer.save_model pickles the TrainingArguments; the recipe config is in results.json already.
    (out / transformers.trainer.TRAINING_ARGS_NAME).unlink(missing_ok=True)
    write_model_card(out, repo_id=cfg.hub_model_id)
    if cfg.push_to_hub:

        push_folder(out, repo_id=cfg.hub_model_id, private=cfg.hub_private)
