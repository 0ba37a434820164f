"""Generation-cache policy: ``generate`` decodes a zoo model with its variant's own cache (:mod:`zoo.cache`) without
any argument (:func:`prepare_generation_cache`, wrapped around transformers' cache preparation in
:mod:`zoo.plug._patches`); :func:`make_cache` returns one for users who pass ``cache=`` or run their own loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.configuration_utils import GenerationMode

from zoo.cache import CacheRollbackError, ZooCache
from zoo.plug.spec import IMPLEMENTATION, variant_for, variant_spec
from zoo.variant import Variant


def make_cache(model: PreTrainedModel | PretrainedConfig) -> ZooCache:
    """A fresh decoding cache for the model's variant.

    Use it as ``model.generate(..., cache=zoo.make_cache(model))`` or ``model(input_ids, cache=cache,
    use_cache=True)`` in a loop of your own. ``generate`` builds one by itself when no cache is given; each
    generation needs its own (the state lives in the cache, not on the model).

    Args:
        model: a model configured with a zoo variant, or its config.

    Returns:
        A `zoo.cache.ZooCache` whose layers the variant chose (a window, a recurrent state, every key, ...).
    """
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
    """``generate``'s cache preparation for zoo models (wrapped in :mod:`zoo.plug._patches`; others run the original).

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
