"""The configuration of a ``zoo eval`` run: one YAML file naming the model, the tasks, the lengths, the contestants
and the measurements. Contestant entries with lists (``policies``, ``budgets``) expand into one contestant each.

Example (``recipes/configs/eval/smollm2_cpu.yaml`` is the full one)::

    model: smollm2                 # the bundled SmolLM2-135M-Instruct, or a folder / Hub id
    output_dir: outputs/eval/smollm2_cpu
    lengths: [1024, 2048]
    samples: 8                     # per task and length (or {1024: 8, 2048: 4})
    tasks:
      - niah_single
      - {task: niah_single, label: niah_single_book, haystack: book, value: uuid, scoring: ruler}
      - {source: ruler, tasks: offline}   # RULER's own tasks through lm-eval (zoo.eval.ruler)
    contestants:
      - {family: full}
      - {family: budget, policies: [tova, snapkv], budgets: [0.5, 0.25]}
      - {family: budget, policies: [{name: snapkv, window: 64, pool: 5}], budgets: [0.25]}
      - {family: window, budgets: [0.25]}
      - {family: quantized, nbits: 4}
      - {family: variant, variant: moba, params: {block_size: 64, top_k: 7}}
      - {family: folder, path: outputs/retrofit/model}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from zoo.cache.policies import DEFAULT_POLICY, as_policy, policy_label
from zoo.eval import ruler
from zoo.eval.scoring import SCORINGS
from zoo.eval.tasks import TASKS
from zoo.registry import get_policy_class

FAMILIES = ("full", "budget", "window", "quantized", "variant", "folder")
TOP_KEYS = {"model", "output_dir", "seed", "threads", "lengths", "samples", "batch", "tasks", "contestants",
            "perplexity", "speed", "kvpress", "depths", "device", "dtype"}
SHARED_FAMILIES = ("full", "budget", "quantized")  # their prefill is the full model's: one prefill serves them all


class EvalConfigError(ValueError):
    """A ``zoo eval`` configuration that cannot run; the message names the key and the fix."""


@dataclass
class TaskSpec:
    """One task of the run: the generator ``task`` with ``options``, reported as ``label``; ``source`` ``zoo`` (the
    zoo's own tasks, :mod:`zoo.eval.tasks`) or ``ruler`` (RULER's, through lm-eval: :mod:`zoo.eval.ruler`)."""

    task: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    samples: dict[int, int] = field(default_factory=dict)
    source: str = "zoo"
    scoring: str = "strict"


@dataclass
class EvalConfig:
    model: str
    output_dir: Path
    lengths: list[int]
    tasks: list[TaskSpec]
    contestants: list[dict[str, Any]]
    seed: int = 0
    threads: int = 2
    batch: int = 0
    depths: list[float] | None = None
    device: str | None = None
    dtype: str | None = None
    perplexity: dict[str, Any] | None = None
    speed: dict[str, Any] | None = None
    kvpress: dict[str, Any] | None = None
    source: dict[str, Any] = field(default_factory=dict)


def _percent(fraction: float) -> str:
    return f"{fraction:.0%}" if round(fraction * 100) == fraction * 100 else f"{fraction:.1%}"


def contestant_name(entry: dict[str, Any]) -> str:
    """The row label of one expanded contestant (``budget snapkv 25%``, ``window + 4 sinks 512 keys``, ...)."""
    family = entry["family"]
    kept = _percent(entry["budget"]) if "budget" in entry else f"{entry['tokens']} keys" if "tokens" in entry else ""
    if family == "full":
        return "full cache"
    if family == "budget":
        return f"budget {policy_label(entry['policy'])} {kept}"
    if family == "window":
        return f"window + 4 sinks {kept}"
    if family == "quantized":
        return f"QuantizedCache {entry['nbits']}-bit"
    if family == "variant":
        params = ", ".join(f"{k}={v}" for k, v in sorted(entry.get("params", {}).items()))
        return f"{entry['variant']}({params})" if params else entry["variant"]
    return f"folder {Path(entry['path']).name}"


def expand_contestants(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per contestant: ``policies`` x ``budgets`` (fractions of the context) or ``tokens`` lists expand."""
    out: list[dict[str, Any]] = []
    for number, raw in enumerate(entries):
        if not isinstance(raw, dict) or raw.get("family") not in FAMILIES:
            raise EvalConfigError(f"contestants[{number}] = {raw!r}: every contestant needs a family, one of "
                                  f"{', '.join(FAMILIES)} ("
                                  "e.g. {family: budget, policies: [tova], budgets: [0.25]}).")
        entry = dict(raw)
        family = entry["family"]
        policies = entry.pop("policies", [entry.pop("policy", DEFAULT_POLICY)]) if family == "budget" else [None]
        for policy in policies if family == "budget" else ():
            _check_policy(policy, number)
        budgets = entry.pop("budgets", None)
        tokens = entry.pop("tokens", None)
        if family in ("budget", "window"):
            if (budgets is None) == (tokens is None):
                raise EvalConfigError(f"contestants[{number}] ({family}): give exactly one of budgets (fractions of "
                                      "the context, e.g. [0.5, 0.25]) or tokens (keys kept, e.g. [512]).")
            kept = [("budget", float(b)) for b in _as_list(budgets)] if budgets is not None else \
                [("tokens", int(t)) for t in _as_list(tokens)]
            for key, value in kept:
                if key == "budget" and not 0 < value <= 1:
                    raise EvalConfigError(f"contestants[{number}]: budget {value} is not a fraction in (0, 1].")
        else:
            kept = [(None, None)]
        if family == "variant" and "variant" not in entry:
            raise EvalConfigError(f"contestants[{number}]: family variant needs `variant: NAME` (and `params`).")
        if family == "folder" and "path" not in entry:
            raise EvalConfigError(f"contestants[{number}]: family folder needs `path: FOLDER` (a saved model).")
        if family == "quantized":
            entry.setdefault("nbits", 4)
        for policy in policies:
            for key, value in kept:
                one = dict(entry)
                if policy is not None:
                    one["policy"] = policy
                if key is not None:
                    one[key] = value
                one.setdefault("name", contestant_name(one))
                out.append(one)
    names = [c["name"] for c in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise EvalConfigError(f"contestants: {repeated} appear more than once; give each a distinct `name`.")
    return out


def _check_policy(spec: Any, number: int) -> None:
    """Refuse a policy that ``budget`` would refuse (unknown name or field, bad value) before any work."""
    try:
        as_policy(spec, get_policy_class)
    except Exception as exc:
        raise EvalConfigError(f"contestants[{number}]: policy {spec!r}: {exc} Give a name (e.g. snapkv) or a "
                              "mapping of its name and fields (e.g. {name: snapkv, window: 64}).") from exc


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _samples_by_length(value: Any, lengths: list[int], where: str) -> dict[int, int]:
    if isinstance(value, dict):
        missing = [n for n in lengths if n not in value]
        if missing:
            raise EvalConfigError(f"{where}: samples gives no count for lengths {missing}.")
        return {n: int(value[n]) for n in lengths}
    return {n: int(value) for n in lengths}


RULER_KEYS = {"source", "tasks", "lengths", "samples", "essays", "chat_template"}


def _ruler_specs(entry: dict[str, Any], number: int, lengths: list[int], samples: Any) -> list[TaskSpec]:
    """``{source: ruler, tasks: [...] | offline | all, essays: auto, chat_template: auto}``: one spec per task."""
    unknown = sorted(set(entry) - RULER_KEYS)
    if unknown:
        raise EvalConfigError(f"tasks[{number}] (source ruler): unknown keys {unknown}; known: "
                              f"{', '.join(sorted(RULER_KEYS))}.")
    here = [int(n) for n in entry.get("lengths", lengths)]
    options = {"essays": entry.get("essays", "auto"), "chat_template": entry.get("chat_template", "auto")}
    specs = []
    try:
        for name in ruler.expand_tasks(entry.get("tasks")):
            ruler.check_options(name, **options)
            specs.append(TaskSpec(name, name, options, here,
                                  _samples_by_length(entry.get("samples", samples), here, f"tasks[{number}]"),
                                  source="ruler", scoring="ruler"))
    except ValueError as exc:
        raise EvalConfigError(f"tasks[{number}] (source ruler): {exc}") from exc
    return specs


def parse_tasks(entries: list[Any], lengths: list[int], samples: Any) -> list[TaskSpec]:
    specs = []
    for number, raw in enumerate(entries):
        entry = {"task": raw} if isinstance(raw, str) else dict(raw)
        if entry.get("source", "zoo") == "ruler":
            specs += _ruler_specs(entry, number, lengths, samples)
            continue
        if entry.pop("source", "zoo") != "zoo":
            raise EvalConfigError(f"tasks[{number}] = {raw!r}: source is zoo (the default) or ruler.")
        task = entry.pop("task", None)
        if task not in TASKS:
            raise EvalConfigError(f"tasks[{number}] = {raw!r}: unknown task {task!r}; known: {', '.join(TASKS)} "
                                  "(RULER's own: {source: ruler, tasks: [...]}).")
        label = entry.pop("label", task)
        scoring = entry.pop("scoring", "strict")
        if scoring not in SCORINGS:
            raise EvalConfigError(f"tasks[{number}] ({label}): scoring {scoring!r}; use one of {', '.join(SCORINGS)}.")
        here = [int(n) for n in entry.pop("lengths", lengths)]
        counts = _samples_by_length(entry.pop("samples", samples), here, f"tasks[{number}] ({label})")
        specs.append(TaskSpec(task, label, entry, here, counts, scoring=scoring))
    labels = [s.label for s in specs]
    repeated = sorted({n for n in labels if labels.count(n) > 1})
    if repeated:
        raise EvalConfigError(f"tasks: the labels {repeated} repeat; give each entry of a task a distinct `label`.")
    return specs


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> EvalConfig:
    """Read and check a ``zoo eval`` YAML config; ``overrides`` replace top-level keys (``output_dir`` ...)."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise EvalConfigError(f"{path}: unknown keys {unknown}; known: {', '.join(sorted(TOP_KEYS))}.")
    for key in ("model", "output_dir", "tasks", "contestants"):
        if key not in raw:
            raise EvalConfigError(f"{path}: `{key}` is missing.")
    lengths = [int(n) for n in raw.get("lengths", [])]
    return EvalConfig(
        model=str(raw["model"]), output_dir=Path(raw["output_dir"]), lengths=lengths,
        tasks=parse_tasks(raw["tasks"], lengths, raw.get("samples", 8)),
        contestants=expand_contestants(raw["contestants"]), seed=int(raw.get("seed", 0)),
        threads=int(raw.get("threads", 2)), batch=int(raw.get("batch", 0)), depths=raw.get("depths"),
        device=raw.get("device"), dtype=raw.get("dtype"),
        perplexity=raw.get("perplexity"), speed=raw.get("speed"), kvpress=raw.get("kvpress"), source=raw,
    )
