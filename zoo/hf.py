"""The Hugging Face plug: one attention implementation (``zoo.IMPLEMENTATION``) that dispatches to the
variant recorded in each model's config, an O(n) padding-mask function, and config persistence.

Why one name for all variants: the variant and its parameters live in ``config.attention_zoo`` (saved in
config.json), so two models with different variants coexist in one process, and a reload needs only
``import zoo``. ``save_pretrained`` does not write the implementation name by itself; we add
``"attn_implementation": IMPLEMENTATION`` to config dicts that carry a zoo variant, so
``AutoModel.from_pretrained`` selects it again (and, without attention-zoo installed, transformers
refuses the unknown implementation -- whose name says ``pip install attention-zoo`` -- instead of
silently running dense attention).

The plug is split by job: this module holds the configure API (:func:`configure`, :func:`variant_for`, the saved
spec's checks) and the registration with transformers plus config persistence (:func:`install`);
:mod:`zoo.dispatch` is the attention function transformers calls (:func:`zoo.dispatch.run_variant`);
:mod:`zoo.generation` is the generation-cache policy (``generate`` gets the variant's own cache,
:func:`zoo.generation.make_cache`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

from transformers import AttentionInterface, AttentionMaskInterface, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import flash_attention_mask

from zoo import _patches
from zoo.registry import UnknownVariantError, get_variant_class, variant_source
from zoo.variant import Variant
from zoo.weights import attach, initialize_missing

logger = logging.getLogger(__name__)

# The registered name is the only text of ours transformers shows when attention-zoo is missing
# ("Specified `attn_implementation=...` is not supported"), so it says what to install.
IMPLEMENTATION = "attention_zoo (pip install attention-zoo, then import zoo)"
CONFIG_KEY = "attention_zoo"
PIP_NAME = "attention-zoo"


class UnsupportedModelError(ValueError):
    """The model's attention does not go through transformers' attention interface."""


# ---------------------------------------------------------------------------------------------------
# configure


def configure(target: PretrainedConfig | PreTrainedModel, name: str, **params: Any):
    """Make a transformers config (or an instantiated model) use variant ``name`` with ``params``.

    Parameters are validated now (a bad value raises naming the parameter and its allowed range).
    Returns the config or model it was given.
    """
    install()
    model = target if isinstance(target, PreTrainedModel) else None
    config = model.config if model is not None else target
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"zoo.configure expects a transformers config or model, got {type(target).__name__}")
    _check_model_supported(config, model)
    variant = get_variant_class(name)(**params)
    if is_decoder_only(config) and not variant.supports_causal:  # an instance may refine it (a hybrid's layers)
        raise ValueError(
            f"attention-zoo variant {name!r} does not support causal attention, but {config.model_type!r} is a "
            f"causal decoder. Pick a variant with causal support (see `zoo list`)."
        )
    source = variant_source(name)
    setattr(
        config,
        CONFIG_KEY,
        {
            "variant": name,
            "params": dict(variant.config),
            "package": source.distribution,
            "version": source.version,
            "state": {},
        },
    )
    if _is_bidirectional_mask_model(config):
        _warn_sliding_window(config, name)
    config._attn_implementation = IMPLEMENTATION
    if model is not None:
        model.set_attn_implementation(IMPLEMENTATION)
        attach(model, zoo_variant_of, replace=True)
    return target


def _model_class_for(config: PretrainedConfig) -> type | None:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    class_name = MODEL_MAPPING_NAMES.get(config.model_type)
    return getattr(transformers, class_name, None) if class_name else None


def _check_model_supported(config: PretrainedConfig, model: PreTrainedModel | None) -> None:
    cls = type(model) if model is not None else _model_class_for(config)
    if cls is not None and not cls.is_backend_compatible():
        raise UnsupportedModelError(
            f"{cls.__name__} ({config.model_type!r}) computes attention in its own code and never calls "
            f"transformers' attention interface, so an attention-zoo variant would be silently ignored. "
            f"Use a model family on the interface (BERT, RoBERTa, DistilBERT, ModernBERT, GPT-2, Llama, "
            f"Qwen2, Mistral, ...), e.g. convert with zoo.longify() on a BERT/RoBERTa checkpoint."
        )


def is_decoder_only(config: PretrainedConfig) -> bool:
    """A causal decoder: a causal-LM family that is not also a masked-LM family, or a config with is_decoder."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    return (
        config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    ) or bool(getattr(config, "is_decoder", False))


def _is_bidirectional_mask_model(config: PretrainedConfig) -> bool:
    return getattr(config, "local_attention", None) is not None  # ModernBERT's local layers


def _warn_sliding_window(config: PretrainedConfig, name: str) -> None:
    logger.warning(
        "%s uses a %s-token sliding window on its local layers; the attention-zoo variant %r replaces the "
        "attention of every layer and does not apply that window.",
        config.model_type,
        config.local_attention,
        name,
    )


# ---------------------------------------------------------------------------------------------------
# the variant of a config

_variants: dict[int, tuple] = {}


def per_config(cache: dict, config: PretrainedConfig, default: Any) -> Any:
    """``cache``'s entry for ``config``, keyed by id() (configs are unhashable); the entry dies with its config."""
    key = id(config)
    if key not in cache:
        cache[key] = default
        weakref.finalize(config, cache.pop, key, None)
    return cache[key]


def variant_for(config: PretrainedConfig) -> Variant:
    """The variant instance configured in ``config`` (cached per config, rebuilt if the config changed)."""
    spec = getattr(config, CONFIG_KEY, None)
    if not spec:
        raise ValueError(
            f"This model uses attn_implementation={IMPLEMENTATION!r} but its config has no {CONFIG_KEY!r} "
            f"entry. Call zoo.configure(config_or_model, 'variant_name', ...) first."
        )
    where = _config_file(config)
    _check_spec(spec, where)
    cached = _variants.get(id(config))
    key = (spec["variant"], repr(spec.get("params", {})))
    if cached is None or cached[0] != key:
        cached = (key, check_saved_spec(spec, where))
        per_config(_variants, config, cached)
        _variants[id(config)] = cached
    return cached[1]


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


# ---------------------------------------------------------------------------------------------------
# registration and persistence

_installed = False


def install() -> None:
    """Register the attention and mask functions with transformers and teach configs to save the variant.

    Runs on ``import zoo``, so it happens in every process an ``accelerate launch`` starts.
    """
    global _installed
    if _installed:
        return
    from zoo.dispatch import zoo_attention_forward  # both modules read the variant through this one
    from zoo.generation import prepare_generation_cache

    AttentionInterface.register(IMPLEMENTATION, zoo_attention_forward)
    # The flash-style mask function yields the 2-D (batch, seq) padding mask (or None): O(n), never n x n.
    AttentionMaskInterface.register(IMPLEMENTATION, flash_attention_mask)
    _patches.apply(
        saved_implementation=_saved_implementation,
        check_model=_check_model_can_run,
        prepare_generation_cache=prepare_generation_cache,
        model_built=_attach_weights,
        checkpoint_loaded=_initialize_missing_weights,
    )
    _installed = True


def _saved_implementation(config: PretrainedConfig) -> str | None:
    """What config.json records as ``attn_implementation``: ours for configs that carry a zoo variant."""
    if getattr(config, CONFIG_KEY, None) and getattr(config, "_attn_implementation", None) == IMPLEMENTATION:
        return IMPLEMENTATION
    return None


def _check_model_can_run(model: PreTrainedModel, requested: str | None) -> None:
    """At model construction, not at the first forward: the family calls the interface, the variant is here."""
    if requested == IMPLEMENTATION:
        _check_model_supported(model.config, model)
        variant_for(model.config)


def _attach_weights(model: PreTrainedModel) -> None:
    """End of a model's __init__ (from_config and from_pretrained): the variant's per-layer weights, if any."""
    if zoo_variant_of(model.config) is not None:
        attach(model, zoo_variant_of)


def _initialize_missing_weights(model: PreTrainedModel) -> None:
    """After a checkpoint was loaded: deterministic values for the variant weights it lacked, one log line."""
    initialize_missing(model, zoo_variant_of)


def variant_spec(config: PretrainedConfig) -> dict[str, Any] | None:
    """The saved ``{"variant", "params", "package", "version"}`` of a config, or None."""
    return getattr(config, CONFIG_KEY, None)
