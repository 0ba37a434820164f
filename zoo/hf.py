"""The Hugging Face plug: one attention implementation (``zoo.IMPLEMENTATION``) that dispatches to the
variant recorded in each model's config, an O(n) padding-mask function, and config persistence.

Why one name for all variants: the variant and its parameters live in ``config.attention_zoo`` (saved in
config.json), so two models with different variants coexist in one process, and a reload needs only
``import zoo``. ``save_pretrained`` does not write the implementation name by itself; we add
``"attn_implementation": IMPLEMENTATION`` to config dicts that carry a zoo variant, so
``AutoModel.from_pretrained`` selects it again (and, without attention-zoo installed, transformers
refuses the unknown implementation -- whose name says ``pip install attention-zoo`` -- instead of
silently running dense attention).

Decoding: ``generate`` gets the variant's own cache (:mod:`zoo.cache`) without any argument
(:func:`prepare_generation_cache`, wrapped around transformers' cache preparation in :mod:`zoo._patches`);
:func:`make_cache` returns one for users who pass ``cache=`` or run their own loop.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.configuration_utils import GenerationMode
from transformers.masking_utils import flash_attention_mask

from zoo import _patches
from zoo.cache import LAYER_KWARG, CacheRollbackError, WindowedLayer, ZooCache
from zoo.ops import expand_kv, flex
from zoo.pattern import row_starts
from zoo.registry import UnknownVariantError, get_variant_class, variant_source
from zoo.variant import AttentionCall, Variant
from zoo.weights import WEIGHTS_NAME, attach, initialize_missing

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
    cls = get_variant_class(name)
    variant = cls(**params)
    if is_decoder_only(config) and not cls.supports_causal:
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
# the attention function transformers calls

# Per-config caches keyed by id() (configs are unhashable); entries die with their config.
_variants: dict[int, tuple] = {}
_layer_counters: dict[int, list[int]] = {}


def _cache_for(cache: dict, config: PretrainedConfig, default: Any) -> Any:
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
        _cache_for(_variants, config, cached)
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


def _layer_index(module: torch.nn.Module) -> int:
    """``module.layer_idx`` if the model sets it, else a stable index in first-call order."""
    idx = getattr(module, "layer_idx", None)
    if idx is not None:
        return int(idx)
    idx = getattr(module, "_attention_zoo_layer_idx", None)
    if idx is None:
        counter = _cache_for(_layer_counters, module.config, [0])
        idx = counter[0]
        counter[0] += 1
        module._attention_zoo_layer_idx = idx
    return idx


def zoo_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers AttentionInterface function: q/k/v (B, H, N, D) in, (B, N, H, D) out."""
    config = module.config
    variant = variant_for(config)
    if kwargs.get("output_attentions"):
        raise ValueError(
            f"output_attentions=True is not available with attention-zoo variant {variant.name!r}: it never "
            "builds the n x n probability matrix. Use attn_implementation='eager' to inspect attention weights."
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"attention-zoo expects a 2-D (batch, seq) padding mask, got shape {tuple(attention_mask.shape)}. "
            "Pass a 2-D attention_mask to the model (custom 4-D masks are not supported)."
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    q_len, kv_len = query.shape[-2], key.shape[-2]
    cross = is_cross_attention(module) or (q_len != kv_len and not causal)
    spec = getattr(config, CONFIG_KEY)
    padding_mask = attention_mask.bool() if attention_mask is not None else None
    cache_layer = kwargs.pop(LAYER_KWARG, None)  # our cache layer, handed over by its update() (zoo.cache)
    row_start = None if cross else row_starts(padding_mask)  # over every token seen (before key_columns)
    positions, decoding = None, kv_len > q_len and not cross
    if cache_layer is not None:
        if isinstance(cache_layer, WindowedLayer):  # it marks each row's sinks from where the row starts
            if cache_layer.rows_known:
                row_start = cache_layer.row_start
            else:
                cache_layer.set_row_start(row_start)
        padding_mask = cache_layer.key_columns(padding_mask)
        positions, decoding = cache_layer.key_positions, cache_layer.seen > q_len
    call = AttentionCall(
        causal=causal,
        scaling=float(scaling if scaling is not None else query.shape[-1] ** -0.5),
        padding_mask=padding_mask,
        dropout=float(dropout),
        training=module.training,
        layer_idx=_layer_index(module),
        extra=kwargs,
        state=spec.setdefault("state", {}),
        cache=cache_layer,
        weights=module._modules.get(WEIGHTS_NAME),
        positions=positions,
        decoding=decoding,
        row_start=row_start,
        cross_attention=cross,
    )
    out = run_variant(variant, query, key, value, call)
    return out.transpose(1, 2).contiguous(), None


def is_cross_attention(module: torch.nn.Module) -> bool:
    """The module attends from one sequence to another (BERT's ``BertCrossAttention``, encoder-decoder models)."""
    return bool(getattr(module, "is_cross_attention", False)) or "CrossAttention" in type(module).__name__


def run_variant(
    variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall
) -> torch.Tensor:
    """Check the call against what the variant supports, run its kernel (or FlexAttention, :mod:`zoo.ops.flex`),
    zero padded query rows. ``k``/``v`` may have fewer (grouped) heads than ``q``.

    Under cross-attention ``call.padding_mask`` covers the keys (the encoder's tokens), not the queries: no row is
    zeroed, as transformers' own implementations do."""
    if call.cross_attention and not variant.supports_cross_attention:
        raise ValueError(
            f"attention-zoo variant {variant.name!r} does not support cross-attention (query length {q.shape[-2]}, "
            f"key length {k.shape[-2]}): its pattern is defined over positions of one sequence. Keep the "
            "cross-attention layers on transformers' attention (attention-zoo replaces every layer's attention, so "
            "use a model without add_cross_attention), or pick a variant that supports it (sdpa, dense)."
        )
    if call.causal and not call.decoding and q.shape[-2] < k.shape[-2]:  # a caller of its own (tests, hybrid)
        call = dataclasses.replace(call, decoding=True)
    if call.causal and not variant.supports_causal:
        raise ValueError(f"attention-zoo variant {variant.name!r} does not support causal attention.")
    if not call.causal and not variant.supports_bidirectional:
        raise ValueError(f"attention-zoo variant {variant.name!r} supports causal attention only.")
    if call.effective_dropout > 0 and not variant.supports_dropout:
        raise ValueError(
            f"attention-zoo variant {variant.name!r} does not support attention dropout (got p={call.dropout}). "
            "Set the model's attention dropout to 0 (e.g. config.attention_probs_dropout_prob=0.0 for BERT, "
            "attention_dropout=0.0 for Llama/ModernBERT)."
        )
    if flex.use_flex(variant, q, k, v, call):  # FlexAttention hook (zoo.ops.flex): GQA keys stay unexpanded
        out = flex.attend(variant, q, k, v, call)
    else:
        out = variant.attend(q, *expand_kv(k, v, q.shape[1]), call)
    if call.padding_mask is not None and not call.cross_attention:
        # the queries are the last keys (the new tokens when a cache holds earlier ones)
        out = out.masked_fill(~call.padding_mask[:, None, -out.shape[-2] :, None], 0.0)
    return out


# ---------------------------------------------------------------------------------------------------
# decoding: the variant's own cache


def make_cache(model: PreTrainedModel | PretrainedConfig) -> ZooCache:
    """A fresh decoding cache for the model's variant: ``model.generate(..., cache=zoo.make_cache(model))`` or
    ``model(input_ids, cache=cache, use_cache=True)`` in a loop of your own. ``generate`` builds one by itself
    when no cache is given; each generation needs its own (the state lives in the cache, not on the model)."""
    config = model.config if isinstance(model, PreTrainedModel) else model
    if not _uses_zoo(config):
        raise ValueError(
            "zoo.make_cache: this model is not configured with an attention-zoo variant; use transformers' "
            "DynamicCache (or call zoo.configure(model, 'variant_name') first)."
        )
    return ZooCache(variant_for(config), config)


def _uses_zoo(config: Any) -> bool:
    return getattr(config, "_attn_implementation", None) == IMPLEMENTATION and bool(variant_spec(config))


def prepare_generation_cache(model: Any, arguments: dict[str, Any], run_original: Callable[[], Any]) -> Any:
    """``generate``'s cache preparation for zoo models (wrapped in :mod:`zoo._patches`; others run the original).

    No cache given: the variant's cache replaces transformers' default ``DynamicCache``. A cache given by the
    user is checked (it must hold every key, or be the variant's). Caches that hold keys the kernels do not
    expect (``cache_implementation="static"``: fixed-size buffers with unfilled slots; sliding or quantized
    layers) are refused instead of decoding different tokens.
    """
    config = getattr(model, "config", None)
    if not _uses_zoo(config):
        return run_original()
    generation_config, model_kwargs = arguments["generation_config"], arguments["model_kwargs"]
    variant = variant_for(config)
    user_cache = model_kwargs.get("cache")
    implementation = generation_config.cache_implementation
    if user_cache is not None:
        _check_user_cache(variant, user_cache)
    elif generation_config.use_cache is not False and implementation not in (None, "dynamic"):
        raise ValueError(
            f"generate(cache_implementation={implementation!r}) is not supported with attention-zoo variant "
            f"{variant.name!r}: that cache holds keys in a layout the variant's kernel does not expect (a static "
            f"cache adds unfilled slots, so it would decode different tokens). Leave cache_implementation unset: "
            f"generate then uses the variant's own cache (the one zoo.make_cache(model) returns)."
        )
    result = run_original()
    cache = model_kwargs.get("cache")
    if user_cache is None and type(cache) is DynamicCache:
        cache = model_kwargs["cache"] = ZooCache(variant, config)
        if getattr(generation_config, "is_assistant", False):
            cache.activate_past_recording()
    if arguments.get("generation_mode") == GenerationMode.ASSISTED_GENERATION and cache is not None:
        if not all(getattr(layer, "is_croppable", True) for layer in cache.layers):
            raise CacheRollbackError(
                f"Assisted decoding rolls the cache back after rejected draft tokens, and attention-zoo variant "
                f"{variant.name!r} keeps a recurrent state (a running sum over every token) that cannot be rolled "
                f"back. Decode without an assistant model, or use a variant that keeps keys."
            )
    return result


def _check_user_cache(variant: Variant, cache: Any) -> None:
    if isinstance(cache, ZooCache):
        if cache.variant_name != variant.name:
            raise ValueError(
                f"This cache was made for attention-zoo variant {cache.variant_name!r}, but the model runs "
                f"{variant.name!r}. Pass zoo.make_cache(model)."
            )
        return
    layers = getattr(cache, "layers", None)
    if layers is not None and all(type(layer) is DynamicLayer for layer in layers):
        return  # every key kept: correct for every variant (just not their memory savings)
    kinds = sorted({type(layer).__name__ for layer in layers or []}) or [type(cache).__name__]
    raise ValueError(
        f"attention-zoo variant {variant.name!r} cannot decode with a {type(cache).__name__} of "
        f"{', '.join(kinds)} layers: they hold a different set of keys than its kernel expects (a static cache adds "
        f"unfilled slots, a sliding cache drops keys by transformers' window), so it would decode different "
        f"tokens. Pass cache=zoo.make_cache(model), or no cache at all."
    )


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
