"""Model cards for zoo output folders: README.md built with huggingface_hub's ModelCard from config.json + results.json.

The metadata (front matter) is what the Hub indexes: ``library_name: transformers``, tags ``attention-zoo`` and the
variant name, datasets, metrics, ``base_model`` for fine-tunes, and a ``model-index`` with the eval results. The
body says how to load the model back (``pip install attention-zoo``, ``import zoo``) and what was measured.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData, get_token
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from zoo.registry import IN_PROCESS
from zoo.reporting import markdown_table, significant

CARD_NAME = "README.md"
CONFIG_NAME = "config.json"
RESULTS_NAME = "results.json"
SAMPLE_NAME = "sample.json"  # language models: a greedy continuation of a held-out passage (training.lm.write_sample)
ZOO_TAG = "attention-zoo"
PLACEHOLDER_REPO_ID = "ORG/NAME"

# Architecture suffix -> (Auto class, Hub pipeline tag).
_HEADS = {
    "ForSequenceClassification": ("AutoModelForSequenceClassification", "text-classification"),
    "ForTokenClassification": ("AutoModelForTokenClassification", "token-classification"),
    "ForQuestionAnswering": ("AutoModelForQuestionAnswering", "question-answering"),
    "ForMaskedLM": ("AutoModelForMaskedLM", "fill-mask"),
    "ForCausalLM": ("AutoModelForCausalLM", "text-generation"),
}
# Config keys that may hold credentials (hub_token, token, api_key, ...): never written to a card.
_SECRET_KEY = re.compile(r"(^|_)(token|secret|password|api_key)$", re.IGNORECASE)


class NotAZooOutputError(ValueError):
    """The folder is not a model saved with an attention-zoo variant."""


def read_zoo_config(folder: str | Path) -> dict[str, Any]:
    """config.json of a zoo output folder; raises NotAZooOutputError if it has no ``attention_zoo`` variant."""
    folder = Path(folder)
    if not folder.is_dir():
        raise NotAZooOutputError(f"{folder} is not a directory. Give the output_dir of a zoo fine-tune.")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise NotAZooOutputError(
            f"{folder} is not an attention-zoo output folder: it has no {CONFIG_NAME}. "
            "Save the model there with model.save_pretrained(folder) first."
        )
    config = json.loads(path.read_text(encoding="utf-8"))
    spec = config.get("attention_zoo")
    if not isinstance(spec, dict) or "variant" not in spec:
        raise NotAZooOutputError(
            f"{path} has no 'attention_zoo' entry, so this is not an attention-zoo model. Configure the model "
            "with zoo.configure(model_or_config, 'variant_name') before save_pretrained."
        )
    return config


def read_results(folder: str | Path) -> dict[str, Any] | None:
    """results.json written by the fine-tune recipe, or None for a folder saved by hand."""
    path = Path(folder) / RESULTS_NAME
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def read_sample(folder: str | Path) -> dict[str, Any] | None:
    """sample.json of a language model's output folder, or None."""
    path = Path(folder) / SAMPLE_NAME
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def build_model_card(output_dir: str | Path, repo_id: str | None = None) -> ModelCard:
    """The model card of ``output_dir``, in memory; ``repo_id`` (ORG/NAME) goes into the loading snippet."""
    config = read_zoo_config(output_dir)
    results = _without_secrets(read_results(output_dir) or {})
    name = repo_id.split("/")[-1] if repo_id else Path(output_dir).resolve().name
    data = card_data(config, results, model_name=name)
    body = card_body(config, results, repo_id or PLACEHOLDER_REPO_ID, name, read_sample(output_dir))
    return ModelCard(_redact_token(f"---\n{data.to_yaml()}\n---\n{body}"))


def write_model_card(output_dir: str | Path, repo_id: str | None = None) -> Path:
    """Write README.md (the model card) into ``output_dir`` atomically; returns its path."""
    card = build_model_card(output_dir, repo_id)
    path = Path(output_dir) / CARD_NAME
    partial = path.with_name(f"_{CARD_NAME}.partial")  # "_*" files are never pushed (zoo.hub.push.IGNORE_PATTERNS)
    card.save(partial)
    os.replace(partial, path)
    return path


# ---------------------------------------------------------------------------------------------------
# metadata


def card_data(config: dict[str, Any], results: dict[str, Any], model_name: str) -> ModelCardData:
    spec = config["attention_zoo"]
    _, pipeline_tag = _head_of(_architecture(config, results))
    dataset = results.get("dataset")
    dataset_id = _dataset_id(dataset, results.get("task"))
    split = (results.get("config") or {}).get("eval_split") or "eval"
    eval_results = _eval_results(results.get("metrics") or {}, pipeline_tag, dataset_id, dataset, split)
    base_model = results.get("base_model")
    return ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=[ZOO_TAG, spec["variant"], "long-context"],
        base_model=base_model if _is_repo_id(base_model) else None,
        datasets=[dataset_id] if dataset_id else None,
        metrics=sorted({r.metric_type for r in eval_results if r.metric_type != "loss"}) or None,
        model_name=model_name if eval_results else None,
        eval_results=eval_results or None,
    )


def _eval_results(
    metrics: dict[str, Any], pipeline_tag: str | None, dataset_id: str | None, dataset: str | None, split: str
) -> list[EvalResult]:
    """The model-index entries: accuracy, macro F1, perplexity and loss on the evaluation split."""
    if not dataset_id:
        return []
    known = [  # (results.json key, Hub metric id, pretty name, metric args)
        ("eval_accuracy", "accuracy", "Accuracy", None),
        ("eval_macro_f1", "f1", "Macro F1", {"average": "macro"}),
        ("eval_perplexity", "perplexity", "Perplexity", None),
        ("eval_loss", "loss", "Eval loss", None),
    ]
    return [
        EvalResult(
            task_type=pipeline_tag or "text-classification",
            dataset_type=dataset_id,
            dataset_name=dataset or dataset_id,
            dataset_split=split,
            metric_type=metric_id,
            metric_name=pretty,
            metric_args=args,
            metric_value=round(float(metrics[key]), 4),
        )
        for key, metric_id, pretty, args in known
        if metrics.get(key) is not None
    ]


def _dataset_id(dataset: str | None, task: str | None) -> str | None:
    """A Hub-style dataset id: the recipe's dataset if it is one (task 'hub'), else the task name (listops, brown)."""
    return dataset if _is_repo_id(dataset) else task


def _is_repo_id(value: Any) -> bool:
    if not isinstance(value, str) or not value:
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _architecture(config: dict[str, Any], results: dict[str, Any]) -> str:
    return results.get("architecture") or (config.get("architectures") or ["AutoModel"])[0]


def _head_of(architecture: str) -> tuple[str, str | None]:
    for suffix, head in _HEADS.items():
        if architecture.endswith(suffix):
            return head
    return "AutoModel", None


# ---------------------------------------------------------------------------------------------------
# body


def card_body(
    config: dict[str, Any], results: dict[str, Any], repo_id: str, name: str, sample: dict[str, Any] | None = None
) -> str:
    spec = config["attention_zoo"]
    architecture = _architecture(config, results)
    sections = [
        f"# {name}\n\n{_summary(config, results, architecture)}",
        _variant_section(spec),
        _loading_section(spec, architecture, repo_id),
        _results_section(results),
        _position_section(results),
        _sample_section(sample),
        _speed_section(results),
        _training_section(results),
    ]
    return "\n\n".join(s.strip() for s in sections if s) + "\n"


def _summary(config: dict[str, Any], results: dict[str, Any], architecture: str) -> str:
    variant = config["attention_zoo"]["variant"]
    if results.get("base_model"):
        start = f" fine-tuned from `{results['base_model']}`"
    else:
        start = " trained from scratch" if results else ""
    task = f" on {results['dataset']} (task `{results.get('task')}`)" if results.get("dataset") else ""
    return (
        f"A `{architecture}` ({config.get('model_type', '?')}){start}{task}, with its attention replaced by the "
        f"**{variant}** variant from [attention-zoo](https://pypi.org/project/attention-zoo/)."
    )


def _variant_section(spec: dict[str, Any]) -> str:
    params = ", ".join(f"`{k}={v!r}`" for k, v in spec.get("params", {}).items()) or "defaults"
    return (
        "## Attention variant\n\n"
        "| variant | parameters | provided by |\n|---|---|---|\n"
        f"| `{spec['variant']}` | {params} | {spec.get('package', '?')} {spec.get('version', '')} |\n\n"
        "The variant and its parameters are stored in `config.json` (`attention_zoo`), so loading restores them."
    )


def _loading_section(spec: dict[str, Any], architecture: str, repo_id: str) -> str:
    auto_class, _ = _head_of(architecture)
    package = spec.get("package") or "attention-zoo"
    plugin = f" {package}" if package not in ("attention-zoo", IN_PROCESS) else ""  # a third-party variant package
    install = f"pip install attention-zoo{plugin}"
    return (
        "## How to load\n\n"
        f"```bash\n{install}\n```\n\n"
        "```python\n"
        "import zoo  # registers the attention-zoo attention implementation with transformers\n"
        f"from transformers import AutoTokenizer, {auto_class}\n\n"
        f'model = {auto_class}.from_pretrained("{repo_id}")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
        f"{_GENERATE_SNIPPET if auto_class == 'AutoModelForCausalLM' else ''}"
        "```\n\n"
        "No `trust_remote_code` is needed. Without `import zoo`, transformers refuses the model's attention "
        "implementation instead of silently running dense attention."
    )


_GENERATE_SNIPPET = (
    'inputs = tokenizer("It was a bright cold day", return_tensors="pt")\n'
    "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0]))\n"
)


def _results_section(results: dict[str, Any]) -> str:
    metrics = results.get("metrics") or {}
    if not metrics:
        return ""
    table = "\n".join(markdown_table(["metric", "value"], [[key, significant(v)] for key, v in metrics.items()]))
    counts = f"{results.get('eval_examples', '?')} eval / {results.get('train_examples', '?')} train examples"
    return f"## Results\n\n{table}\n\n{counts}, max_length {results.get('max_length')}."


def _position_section(results: dict[str, Any]) -> str:
    buckets = [b for b in results.get("loss_by_position") or [] if b.get("loss") is not None]
    if not buckets:
        return ""
    table = markdown_table(
        ["token position", "mean loss", "tokens"], [[b["bucket"], f"{b['loss']:.4f}", b["tokens"]] for b in buckets]
    )
    return (
        "## Loss by token position\n\nEvaluation chunks never cross a document boundary, so a token at position p is "
        "predicted from the p tokens of its own document before it; a lower loss in the late buckets means the "
        "model uses far context.\n\n" + "\n".join(table)
    )


def _sample_section(sample: dict[str, Any] | None) -> str:
    if not sample:
        return ""
    return (
        f"## Sample\n\nGreedy continuation ({sample['new_tokens']} tokens) of a held-out passage ({sample['source']}, "
        f"{sample['prompt_tokens']} prompt tokens); the prompt's end, then the continuation:\n\n"
        f"```text\n{sample['prompt_tail']}\n```\n\n```text\n{sample['continuation']}\n```"
    )


def _speed_section(results: dict[str, Any]) -> str:
    columns = {  # results.json key -> column title
        "train_tokens_per_second": "train tokens/s",
        "eval_tokens_per_second": "eval tokens/s",
        "decode_tokens_per_second": "decode tokens/s",
        "peak_memory_mb": "peak memory (MB)",
        "wall_time_seconds": "wall time (s)",
        "num_processes": "processes",
        "distributed_type": "distributed",
    }
    columns = {k: v for k, v in columns.items() if k in results}  # e.g. no decode speed for a classifier
    if not any(results.get(k) is not None for k in columns):
        return ""
    table = markdown_table(list(columns.values()), [[significant(results.get(k)) for k in columns]])
    return "## Speed and memory (measured during this fine-tune)\n\n" + "\n".join(table)


def _training_section(results: dict[str, Any]) -> str:
    if not results:
        return ""
    facts = {
        k: results.get(k)
        for k in ("model", "base_model", "num_labels", "label_names", "seed", "num_train_epochs", "max_steps")
    }
    lines = "".join(f"- {k}: `{v}`\n" for k, v in facts.items() if v is not None)
    packages = ", ".join(f"{k} {v}" for k, v in (results.get("packages") or {}).items())
    text = f"## Training\n\n{lines}" + (f"- packages: {packages}\n" if packages else "")
    if results.get("config"):
        text += f"\nRecipe config as run:\n\n```yaml\n{yaml.safe_dump(results['config'], sort_keys=False)}```"
    return text


# ---------------------------------------------------------------------------------------------------
# secrets


def _without_secrets(value: Any) -> Any:
    """A copy of ``value`` with every credential-like key (hub_token, api_key, ...) removed."""
    if isinstance(value, dict):
        return {k: _without_secrets(v) for k, v in value.items() if not _SECRET_KEY.search(str(k))}
    if isinstance(value, list):
        return [_without_secrets(v) for v in value]
    return value


def _redact_token(text: str) -> str:
    """Last guard: the user's Hub token never ends up in a card, whatever key it hid under."""
    token = get_token()
    return text.replace(token, "<redacted>") if token else text
