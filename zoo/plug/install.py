"""Registration with transformers and :func:`configure`: the attention function (:mod:`zoo.plug.dispatch`) and an O(n)
padding-mask function under one implementation name (:data:`zoo.plug.spec.IMPLEMENTATION`), ``generate``'s cache
policy (:mod:`zoo.plug.generation`), the variant's learned weights (:mod:`zoo.plug.weights`), and config persistence
(:mod:`zoo.plug._patches`).

``save_pretrained`` does not write the implementation name by itself; we add ``"attn_implementation":
IMPLEMENTATION`` to config dicts that carry a zoo variant, so ``AutoModel.from_pretrained`` selects it again (and,
without attention-zoo installed, transformers refuses the unknown implementation -- whose name says ``pip install
attention-zoo`` -- instead of silently running dense attention).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PretrainedConfig, PreTrainedModel

from zoo.plug import _patches
from zoo.plug.dispatch import zoo_attention_forward
from zoo.plug.generation import prepare_generation_cache
from zoo.plug.spec import (
    CONFIG_KEY,
    IMPLEMENTATION,
    check_model_supported,
    is_decoder_only,
    per_config,
    remember_variant,
    variant_for,
    zoo_variant_of,
)
from zoo.plug.weights import attach, initialize_missing
from zoo.registry import get_variant_class, variant_source
from zoo.variant import Variant

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# configure


def configure(target: PretrainedConfig | PreTrainedModel, name: str, **params: Any):
    """Make a transformers config (or an instantiated model) use variant ``name`` with ``params``.

    Parameters are validated now (a bad value raises naming the parameter and its allowed range).
    Returns the config or model it was given.
    """
    return configure_variant(target, get_variant_class(name)(**params), name)


def configure_variant(target: PretrainedConfig | PreTrainedModel, variant: Variant, name: str | None = None):
    """:func:`configure` with a variant instance already built (a fine-tune builds it once, :mod:`zoo.training`):
    the config records its name (``name``, else ``variant.name``) and parameters, and its attention calls use this
    instance.

    Returns the config or model it was given.
    """
    install()
    name = name or variant.name
    model = target if isinstance(target, PreTrainedModel) else None
    config = model.config if model is not None else target
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"zoo.configure expects a transformers config or model, got {type(target).__name__}")
    check_model_supported(config, model)
    if is_decoder_only(config) and not variant.supports_causal:  # an instance may refine it (a hybrid's layers)
        raise ValueError(
            f"attention-zoo variant {name!r} does not support causal attention, but {config.model_type!r} is a "
            f"causal decoder. Pick a variant with causal support (see `zoo list`)."
        )
    source = variant_source(name)
    spec = {"variant": name, "params": dict(variant.config), "package": source.distribution,
            "version": source.version, "state": {}}
    setattr(config, CONFIG_KEY, spec)
    remember_variant(config, variant)
    if _is_bidirectional_mask_model(config):
        _warn_sliding_window(config, name)
    config._attn_implementation = IMPLEMENTATION
    if model is not None:
        model.set_attn_implementation(IMPLEMENTATION)
        attach(model, zoo_variant_of, replace=True)
    return target


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
    # A 2-D (batch, seq) padding mask (or None): O(n), never n x n.
    AttentionMaskInterface.register(IMPLEMENTATION, padding_mask)
    _patches.apply(
        saved_implementation=_saved_implementation,
        check_model=_check_model_can_run,
        prepare_generation_cache=prepare_generation_cache,
        model_built=_attach_weights,
        checkpoint_loaded=_initialize_missing_weights,
        kernels_set=check_attention_not_kernelized,
    )
    _installed = True


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask function of the zoo implementation: the 2-D (batch, kv_length) padding mask, the last ``kv_length``
    columns of ``attention_mask`` (what ``transformers.masking_utils.flash_attention_mask`` returns), or None.

    Eager, an all-real mask is dropped (None: kernels take their unpadded path). Inside a compiled or exported graph
    it is kept: testing it would read the tensor on the host and break the graph, and every kernel gives the same
    result for an all-True mask."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if torch.compiler.is_compiling() or attention_mask.shape[1] != kv_length:
        return attention_mask
    return None if bool(attention_mask.all()) else attention_mask


def _saved_implementation(config: PretrainedConfig) -> str | None:
    """What config.json records as ``attn_implementation``: ours for configs that carry a zoo variant."""
    if getattr(config, CONFIG_KEY, None) and getattr(config, "_attn_implementation", None) == IMPLEMENTATION:
        return IMPLEMENTATION
    return None


_switched_away: dict[int, dict] = {}  # per config: the attention_zoo entry of a model switched to another one


def _check_model_can_run(model: PreTrainedModel, requested: str | None) -> None:
    """At model construction, not at the first forward: the family calls the interface, the variant is here.

    A model that carries a zoo variant and is switched to another implementation (``set_attn_implementation("sdpa")``,
    ``from_pretrained(zoo_checkpoint, attn_implementation="sdpa")``) drops its ``attention_zoo`` entry, so a save no
    longer records a variant that does not run; it is kept aside (in memory) and comes back if the model is switched
    back to the zoo."""
    config = model.config
    if requested == IMPLEMENTATION:
        kept = _switched_away.pop(id(config), None)
        if kept is not None and not getattr(config, CONFIG_KEY, None):
            setattr(config, CONFIG_KEY, kept)
            logger.warning("attention-zoo: %s runs variant %r again.", type(model).__name__, kept.get("variant"))
        check_model_supported(config, model)
        variant_for(config)
    elif isinstance(requested, str) and getattr(config, CONFIG_KEY, None):
        spec = getattr(config, CONFIG_KEY)
        delattr(config, CONFIG_KEY)
        per_config(_switched_away, config, spec)  # the entry dies with the config
        _switched_away[id(config)] = spec
        logger.warning(
            "attention-zoo: %s now uses attn_implementation=%r, so its config no longer records the attention-zoo "
            "variant %r (set_attn_implementation back to the zoo's, or zoo.configure, to run it again).",
            type(model).__name__, requested, spec.get("variant"),
        )


def _attach_weights(model: PreTrainedModel) -> None:
    """End of a model's __init__ (from_config and from_pretrained): the variant's per-layer weights, if any."""
    if zoo_variant_of(model.config) is not None:
        attach(model, zoo_variant_of)


def check_attention_not_kernelized(model: PreTrainedModel) -> None:
    """After hub kernels were applied (``from_pretrained(use_kernels=True)``, the default from transformers 5.25):
    they replace the ``forward`` of the layers their mapping names (norms, activations, rotary, some linear-attention
    layers), never the attention function a model dispatches to. A mapping that names an attention layer would bypass
    the zoo's variant without a word, so it is refused here."""
    variant = zoo_variant_of(model.config)
    if variant is None:
        return
    classes, names = _patches.declared_attention_classes(model)
    replaced = sorted({name for name, module in model.named_modules()
                       if (isinstance(module, tuple(classes)) or type(module).__name__ in names)
                       and _patches.forward_replaced(module)})
    if replaced:
        raise ValueError(
            f"Hub kernels replaced the forward of {len(replaced)} attention layers of this attention-zoo model "
            f"({replaced[0]}, ...): the variant {variant.name!r} would no longer run. "
            "Load it with use_kernels=False, or give a kernel_config whose mapping leaves the attention layers out."
        )


def _initialize_missing_weights(model: PreTrainedModel) -> None:
    """After a checkpoint was loaded: deterministic values for the variant weights it lacked, one log line."""
    initialize_missing(model, zoo_variant_of)
