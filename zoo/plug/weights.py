"""Per-layer learned weights of a variant: created with the model, trained, saved and loaded like any parameter.

A variant that owns weights (Linformer's length projections, Longformer's global projections, ...) returns an
``nn.Module`` from :meth:`zoo.Variant.make_module`. The zoo attaches one to every attention module of the model
under the fixed name :data:`WEIGHTS_NAME` (``...attention.self.attention_zoo.<param>`` in the state dict), when
the model is built (``from_config``, ``from_pretrained``, both through ``PreTrainedModel.post_init``) or when
:func:`zoo.configure` is called on a built model. The kernel reads it as ``call.weights``.

Initialisation is deterministic: a layer's module is what ``make_module`` builds on the CPU in float32 right
after ``torch.manual_seed(seed_for(variant, layer))``, so two processes (or a checkpoint that lacks the
weights, see :func:`initialize_missing`) get the same values without touching the global random state.

Attention modules are the classes the model family declares as recording ``attentions`` (what
``output_attentions`` hooks), found by :func:`~zoo.plug._patches.declared_attention_classes`. Each module has a
``config`` (the plug reads ``module.config`` too). Every private transformers symbol used here is in
:mod:`zoo.plug._patches`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import zlib
from collections.abc import Iterator

import torch
from torch import nn

from zoo.plug import _patches
from zoo.variant import LayerWeights, Variant

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "attention_zoo"
HOOKED = "_attention_zoo_hooks"  # set on an attention module once its hidden-states hooks are registered
# transformers reports missing keys matching these as "newly initialized"; we report ours in one line instead.
MISSING_KEYS_PATTERN = rf"\.{WEIGHTS_NAME}\."

def attention_modules(model: nn.Module) -> Iterator[tuple[str, int, nn.Module]]:
    """``(qualified name, layer index, module)`` of every attention module, in model order.

    The attention modules are those the model family declares (:func:`zoo.plug._patches.declared_attention_classes`);
    for a family that declares none, those whose ``forward`` calls the attention interface.
    The layer index is the module's ``layer_idx`` when the model sets one, else its rank in model order (which is
    also recorded on the module, so the plug's :func:`zoo.plug.dispatch._layer_index` agrees with it).
    """
    classes, names = _patches.declared_attention_classes(model)

    def is_attention(module: nn.Module) -> bool:
        cls = type(module)
        if classes or names:
            return cls in classes or cls.__name__ in names
        return _patches.calls_attention_interface(cls)

    rank = 0
    for name, module in model.named_modules():
        if not (is_attention(module) and hasattr(module, "config")):
            continue
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            idx = getattr(module, "_attention_zoo_layer_idx", None)
            if idx is None:
                idx = module._attention_zoo_layer_idx = rank
        rank += 1
        yield name, int(idx), module


def seed_for(variant: Variant, layer_idx: int) -> int:
    """The seed a layer's weights are drawn with: stable across processes, machines and Python hash seeds."""
    return zlib.crc32(variant.name.encode()) + 1009 * layer_idx


def head_shape(module: nn.Module) -> tuple[int, int]:
    """``(head_dim, num_heads)`` of an attention module (query heads)."""
    config = module.config
    num_heads = int(config.num_attention_heads)
    head_dim = getattr(module, "head_dim", None) or getattr(module, "attention_head_size", None)
    if head_dim is None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return int(head_dim), num_heads


@contextlib.contextmanager
def _float32_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build(
    variant: Variant, layer_idx: int, config, head_dim: int, num_heads: int, device: torch.device | str = "cpu"
) -> nn.Module | None:
    """The variant's weights for one layer, deterministically initialised (float32); None if it has none.

    Tests of a kernel outside a model pass the result as ``AttentionCall(weights=...)``. On the meta device
    nothing is drawn (from_pretrained builds there, then loads or calls :func:`initialize_missing`).
    """
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return variant.make_module(layer_idx, config, head_dim, num_heads)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), _float32_default():
        torch.manual_seed(seed_for(variant, layer_idx))
        return variant.make_module(layer_idx, config, head_dim, num_heads)


def build_for(variant: Variant, module: nn.Module, layer_idx: int, device: torch.device | str = "cpu"):
    """:func:`build` for one attention module of a model (its config and head shape)."""
    return build(variant, layer_idx, module.config, *head_shape(module), device=device)


def _reference_tensor(module: nn.Module) -> torch.Tensor | None:
    for tensor in module.parameters(recurse=False):
        return tensor
    return next(iter(module.parameters()), None)


def attach(model: nn.Module, variant_of, replace: bool = False) -> int:
    """Give every attention module of ``model`` (using the zoo) its variant's weights; returns how many it made.

    ``variant_of(config)`` returns the variant configured for a module's config, or None if the module does not
    use the zoo. Modules that already have weights keep them unless ``replace`` (``zoo.configure`` on a model).
    """
    made = 0
    for _, idx, module in attention_modules(model):
        variant = variant_of(module.config)
        if replace and WEIGHTS_NAME in module._modules:
            del module._modules[WEIGHTS_NAME]
        if variant is None or WEIGHTS_NAME in module._modules:
            continue
        reference = _reference_tensor(module)
        device = reference.device if reference is not None else torch.device("cpu")
        weights = build_for(variant, module, idx, device)
        if weights is None:
            continue
        _check_declared_hooks(variant, weights)
        if reference is not None:
            weights = weights.to(device=device, dtype=reference.dtype if reference.is_floating_point() else None)
        if device.type != "meta":
            _initialize_from(weights, module)
        _patches.mark_initialized(weights)  # transformers' own init must not redraw them (see initialize_missing)
        module.add_module(WEIGHTS_NAME, weights)
        if isinstance(weights, LayerWeights) and weights.needs_hidden_states and not hasattr(module, HOOKED):
            module.register_forward_pre_hook(_keep_hidden_states, with_kwargs=True)
            module.register_forward_hook(_drop_hidden_states, always_call=True)
            setattr(module, HOOKED, True)
        made += 1
    if made:
        _patches.ignore_missing_keys(model, MISSING_KEYS_PATTERN)
    return made


def _check_declared_hooks(variant, weights: nn.Module) -> None:
    """The hooks are declared by subclassing :class:`zoo.LayerWeights`; a plain module that names them would silently
    not get them (no hidden states, no derived values), so it is refused."""
    named = [hook for hook in ("needs_hidden_states", "initialize_from", "auxiliary_loss") if hook in dir(weights)]
    if named and not isinstance(weights, LayerWeights):
        raise TypeError(
            f"attention-zoo variant {variant.name!r}: make_module returned a {type(weights).__name__} that defines "
            f"{' and '.join(named)} but is not a zoo.LayerWeights, so the zoo would not call it. Subclass "
            "zoo.LayerWeights (from zoo import LayerWeights) instead of torch.nn.Module."
        )


def _initialize_from(weights: nn.Module, module: nn.Module) -> None:
    """:meth:`zoo.LayerWeights.initialize_from`: initial values derived from the layer's own (e.g. Longformer's
    global projections start as copies of the local q/k/v, as in the paper's conversion)."""
    if isinstance(weights, LayerWeights):
        with torch.no_grad():
            weights.initialize_from(module)


def _keep_hidden_states(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Hands the attention module's input to weights that declare ``needs_hidden_states`` (e.g. Longformer's
    global projections, which project the hidden states, not the layer's q/k/v)."""
    weights = module._modules.get(WEIGHTS_NAME)
    if weights is not None:
        weights.hidden_states = args[0] if args else kwargs.get("hidden_states")


def _drop_hidden_states(module: nn.Module, args: tuple, output) -> None:
    weights = module._modules.get(WEIGHTS_NAME)
    if weights is not None:
        weights.hidden_states = None


def initialize_missing(model: nn.Module, variant_of) -> list[str]:
    """After a checkpoint was loaded: give the zoo weights it lacked their deterministic values; log them once.

    transformers marks what it loaded (:func:`zoo.plug._patches.was_loaded`); every other parameter or buffer of a zoo
    weights module is rebuilt with :func:`build_for` and copied in. Returns the missing state-dict keys.
    """
    if not any(WEIGHTS_NAME in m._modules for m in model.modules()):
        return []
    missing = []
    for name, idx, module in attention_modules(model):
        weights = module._modules.get(WEIGHTS_NAME)
        variant = variant_of(module.config)
        if weights is None or variant is None:
            continue
        tensors = weights.state_dict(keep_vars=True)
        todo = [key for key, t in tensors.items() if not _patches.was_loaded(t)]
        if not todo:
            continue
        fresh = build_for(variant, module, idx)
        _initialize_from(fresh, module)
        fresh = fresh.state_dict()
        with torch.no_grad():
            for key in todo:
                tensors[key].copy_(fresh[key])
        missing += [f"{name}.{WEIGHTS_NAME}.{key}" if name else f"{WEIGHTS_NAME}.{key}" for key in todo]
    if missing:
        logger.warning(
            "attention-zoo: the checkpoint has no weights for the variant's %d per-layer tensors (%s); "
            "they were initialised deterministically (seeded by layer) and need training.",
            len(missing),
            summarize_keys(missing),
        )
    return missing


def summarize_keys(keys: list[str]) -> str:
    """``a.0.x, a.1.x, a.0.y`` -> ``a.*.x, a.*.y`` (layer numbers folded), for one readable log line."""
    folded = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", key) for key in keys)
    return ", ".join(folded)
