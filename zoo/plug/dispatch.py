"""The attention function transformers calls for every zoo model (registered by :func:`zoo.plug.install.install`).

:func:`zoo_attention_forward` turns transformers' call into an :class:`~zoo.variant.AttentionCall` once -- causality,
padding, cross-attention, where each row starts, the decoding cache layer, positions and whether it decodes -- and
:func:`run_variant` checks it against what the variant supports and runs its kernel (or FlexAttention,
:mod:`zoo.ops.backends.flex`). Tests and benchmarks call :func:`run_variant` directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zoo.cache import LAYER_KWARG
from zoo.call import AttentionCall
from zoo.ops import expand_kv
from zoo.ops.backends import flex
from zoo.pattern import row_starts
from zoo.plug import _patches
from zoo.plug.backend import after_flex_failure, compiled, flex_pattern
from zoo.plug.spec import CONFIG_KEY, per_config, variant_for
from zoo.plug.weights import WEIGHTS_NAME
from zoo.variant import Variant

_layer_counters: dict[int, list[int]] = {}  # per config: the next index for families without module.layer_idx

def _layer_index(module: torch.nn.Module) -> int:
    """``module.layer_idx`` if the model sets it, else a stable index in first-call order."""
    idx = getattr(module, "layer_idx", None)
    if idx is not None:
        return int(idx)
    idx = getattr(module, "_attention_zoo_layer_idx", None)
    if idx is None:
        counter = per_config(_layer_counters, module.config, [0])
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
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"torch.jit.trace cannot record attention-zoo variant {variant.name!r}: its kernels decide on the host "
            "(is the batch padded, where rows start, which chunks to run) and use custom autograd Functions, so a "
            "trace would replay one input's decisions for every input, or fail inside the kernel. Use torch.export "
            "(it guards those decisions) or torch.compile instead; TorchScript is deprecated in PyTorch."
        )
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
    # a zoo cache layer, handed over by its update(): the plug speaks to it through zoo.cache.ZooCacheLayer only
    cache_layer = kwargs.pop(LAYER_KWARG, None)
    positions, decoding = None, kv_len > q_len and not cross
    if cache_layer is not None and cache_layer.rows_known:  # a later call: the layer holds the row starts
        row_start, padding_mask = cache_layer.row_start, cache_layer.kept_keys_padding(attention_mask)
    else:
        padding_mask = attention_mask.bool() if attention_mask is not None else None
        row_start = None if cross else row_starts(padding_mask)  # over every token seen (before key_columns)
        if cache_layer is not None:
            cache_layer.set_row_start(row_start)  # e.g. a window cache marks each row's sinks from where it starts
            padding_mask = cache_layer.key_columns(padding_mask)
    if cache_layer is not None:
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
        recomputed=module.training and not torch.compiler.is_compiling() and _patches.in_backward(),
    )
    device_type = query.device.type
    query, key, value = in_compute_dtype(query, key, value, device_type)
    if torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type=device_type, enabled=False):  # kernels choose their fp32 parts
            out = run_variant(variant, query, key, value, call)
    else:  # no context to enter on every call (a decoding step is a few dozen small ops)
        out = run_variant(variant, query, key, value, call)
    if cache_layer is not None:
        cache_layer.after_call()  # the keys were read (a window cache drops what no later query reaches)
    return out.transpose(1, 2).contiguous(), None


def in_compute_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, device_type: str | None = None):
    """q/k/v in one dtype, once, before any kernel: under autocast its dtype for the device (the rotary embedding
    returns fp32 q/k while v is bf16, and the CPU flash kernels autocast does not cover need one dtype); else the
    values' dtype. Kernels then run with autocast off, keep softmax statistics and recurrent states in fp32
    themselves, and return this dtype."""
    device = device_type or query.device.type
    target = value.dtype
    if torch.is_autocast_enabled(device) and query.is_floating_point():
        target = torch.get_autocast_dtype(device)
    elif query.dtype == key.dtype == target:
        return query, key, value
    return tuple(x if x.dtype == target else x.to(target) for x in (query, key, value))


def is_cross_attention(module: torch.nn.Module) -> bool:
    """The module attends from one sequence to another (BERT's ``BertCrossAttention``, encoder-decoder models)."""
    if "CrossAttention" in type(module).__name__:
        return True
    flag = vars(module).get("is_cross_attention", getattr(type(module), "is_cross_attention", False))
    return bool(flag)


def run_variant(
    variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall
) -> torch.Tensor:
    """Check the call against what the variant supports, run its kernel (or FlexAttention,
    :mod:`zoo.ops.backends.flex`), zero padded query rows. ``k``/``v`` may have fewer (grouped) heads than ``q``.

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
    variant.check_call(call)
    pattern = flex_pattern(variant, q, k, v, call)  # None: the variant's own kernel (zoo.plug.backend)
    out = None
    if pattern is not None:  # FlexAttention: GQA keys stay unexpanded
        try:
            out = flex.attend(pattern, q, k, v, call, compiled=compiled())
        except flex.FlexRecompileLimitError as exc:  # never eager Flex: the chunked kernel (or, forced, an error)
            after_flex_failure(variant, exc)
    if out is None:
        if not variant.grouped_kv:  # the variant's kernel expects one key/value head per query head
            k, v = expand_kv(k, v, q.shape[1])
        out = variant.attend(q, k, v, call)
    if call.padding_mask is not None and not call.cross_attention:
        # the queries are the last keys (the new tokens when a cache holds earlier ones)
        out = out.masked_fill(~call.padding_mask[:, None, -out.shape[-2] :, None], 0.0)
    return out
