"""Which variant a transformers config names: the ``attention_zoo`` entry of its config (saved in config.json), checked
and turned into a :class:`~zoo.variant.Variant` once per config (:func:`variant_for`, read on every attention call),
and which models can run one at all.

Why one implementation name for all variants: the variant and its parameters live in ``config.attention_zoo``, so two
models with different variants coexist in one process, and a reload needs only ``import zoo``.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping
from typing import Any

import transformers
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
)

from zoo.registry import UnknownVariantError, get_variant_class
from zoo.variant import Variant

# The registered name is the only text of ours transformers shows when attention-zoo is missing
# ("Specified `attn_implementation=...` is not supported"), so it says what to install.
IMPLEMENTATION = "attention_zoo (pip install attention-zoo, then import zoo)"
CONFIG_KEY = "attention_zoo"


class UnsupportedModelError(ValueError):
    """The model's attention does not go through transformers' attention interface."""


def _model_class_for(config: PretrainedConfig) -> type | None:
    class_name = MODEL_MAPPING_NAMES.get(config.model_type)
    return getattr(transformers, class_name, None) if class_name else None


def check_model_supported(config: PretrainedConfig, model: PreTrainedModel | None) -> None:
    cls = type(model) if model is not None else _model_class_for(config)
    if cls is not None and not cls.is_backend_compatible():
        raise UnsupportedModelError(
            f"{cls.__name__} ({config.model_type!r}) computes attention in its own code and never calls "
            f"transformers' attention interface, so an attention-zoo variant would be silently ignored. "
            f"Use a model family on the interface (BERT, RoBERTa, DistilBERT, ModernBERT, GPT-2, Llama, "
            f"Qwen2, Mistral, ...), e.g. convert with zoo.convert.longify() on a BERT/RoBERTa checkpoint."
        )


def is_decoder_only(config: PretrainedConfig) -> bool:
    """A causal decoder: a causal-LM family that is not also a masked-LM family, or a config with is_decoder."""
    return (
        config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    ) or bool(getattr(config, "is_decoder", False))


_variants: dict[int, tuple] = {}


def per_config(cache: dict, config: PretrainedConfig, default: Any) -> Any:
    """``cache``'s entry for ``config``, keyed by id() (configs are unhashable); the entry dies with its config."""
    key = id(config)
    if key not in cache:
        cache[key] = default
        weakref.finalize(config, cache.pop, key, None)
    return cache[key]


def variant_for(config: PretrainedConfig) -> Variant:
    """The variant instance configured in ``config`` (cached per config, rebuilt if the config changed).

    Read on every attention call: while the ``attention_zoo`` entry is the same object with the same variant and
    parameters (compared with a copy, so an edit in place counts), the cached instance is returned unchecked."""
    spec = getattr(config, CONFIG_KEY, None)
    cached = _variants.get(id(config))
    if cached is not None and cached[0] is spec and cached[1] == _spec_key(spec):
        return cached[2]
    if not spec:
        raise ValueError(
            f"This model uses attn_implementation={IMPLEMENTATION!r} but its config has no {CONFIG_KEY!r} "
            f"entry. Call zoo.configure(config_or_model, 'variant_name', ...) first."
        )
    where = _config_file(config)
    _check_spec(spec, where)
    key = _spec_key(spec)
    if cached is None or cached[1] != key:
        cached = (spec, copy.deepcopy(key), check_saved_spec(spec, where))
    else:  # the same variant and parameters in another entry object
        cached = (spec, cached[1], cached[2])
    per_config(_variants, config, cached)
    _variants[id(config)] = cached
    return cached[2]


def remember_variant(config: PretrainedConfig, variant: Variant) -> None:
    """Let :func:`variant_for` return ``variant`` for ``config`` (whose entry ``configure`` just wrote from it)
    instead of building it again; the memo is checked as any other: an edited entry builds its own variant."""
    spec = getattr(config, CONFIG_KEY)
    cached = (spec, copy.deepcopy(_spec_key(spec)), variant)
    per_config(_variants, config, cached)
    _variants[id(config)] = cached


def _spec_key(spec: Any) -> tuple:
    """What decides the variant instance: its name and parameters."""
    return (spec.get("variant"), spec.get("params", {})) if isinstance(spec, Mapping) else (None, spec)


def _config_file(config: PretrainedConfig) -> str:
    return f"config.json in {config.name_or_path!r}" if getattr(config, "name_or_path", "") else "the model config"


def check_saved_spec(spec: Any, where: str) -> Variant:
    """The variant a saved ``attention_zoo`` entry describes, after every check ``from_pretrained`` makes: the
    entry's shape, the variant installed, its parameters valid, its persisted ``state`` well formed.
    ``where`` names the file in the errors."""
    _check_spec(spec, where)
    try:
        cls = get_variant_class(spec["variant"])
    except UnknownVariantError as exc:
        raise UnknownVariantError(
            f"{where} was saved with attention-zoo variant {spec['variant']!r} from package "
            f"{spec.get('package')!r} {spec.get('version', '')}, which is not installed here. "
            f"Install it (pip install {spec.get('package')}) and import zoo before loading."
        ) from exc
    state = spec.get("state", {})
    try:
        cls.check_state(state)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"The persisted 'state' of attention-zoo variant {spec['variant']!r} in the {CONFIG_KEY!r} entry of "
            f"{where} is corrupted: {exc} Fix it, or set it to {{}} (the variant starts its state afresh)."
        ) from exc
    return cls(**spec.get("params", {}))


def _check_spec(spec: Any, where: str) -> None:
    """A readable error for a hand-edited or corrupted ``attention_zoo`` entry (naming the entry and the file)."""
    example = "{'variant': 'longformer', 'params': {'window': 512}, ...}"
    if not isinstance(spec, Mapping) or not isinstance(spec.get("variant"), str):
        raise ValueError(
            f"The {CONFIG_KEY!r} entry of {where} must be a mapping with a 'variant' name, like {example}; got "
            f"{spec!r}. Fix that entry, or configure the model again with zoo.configure(model, 'variant_name', ...)."
        )
    for entry in ("params", "state"):
        if not isinstance(spec.get(entry, {}), Mapping):
            raise ValueError(
                f"{entry!r} of the {CONFIG_KEY!r} entry of {where} (variant {spec['variant']!r}) must be a mapping, "
                f"like {example}; got {spec[entry]!r}. Fix that entry, or configure the model again with "
                "zoo.configure."
            )


def zoo_variant_of(config: PretrainedConfig) -> Variant | None:
    """The variant a config runs, or None when the config does not use the zoo."""
    if getattr(config, "_attn_implementation", None) != IMPLEMENTATION or not getattr(config, CONFIG_KEY, None):
        return None
    return variant_for(config)


def variant_spec(config: PretrainedConfig) -> dict[str, Any] | None:
    """The saved ``{"variant", "params", "package", "version"}`` of a config, or None."""
    return getattr(config, CONFIG_KEY, None)
