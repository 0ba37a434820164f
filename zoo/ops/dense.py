"""Dense helpers: GQA expansion, the O(n²) reference mask and softmax attention, SDPA over a padded batch with
the real tokens first, padding to a block multiple.

Everything here works on ``(batch, heads, seq, head_dim)`` tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from zoo.call import AttentionCall
from zoo.ops import limits
from zoo.pattern import MaskMod, dense_mask


def expand_kv(key: torch.Tensor, value: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat grouped key/value heads (Llama, Qwen, Mistral GQA) to the number of query heads."""
    groups = num_heads // key.shape[1]
    if groups * key.shape[1] != num_heads:
        raise ValueError(f"{num_heads} query heads cannot share {key.shape[1]} key/value heads evenly")
    if groups == 1:
        return key, value
    return repeat_kv(key, groups), repeat_kv(value, groups)


def allowed_mask(
    call: AttentionCall,
    pattern: MaskMod | None,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor | None:
    """Dense ``(batch|1, heads|1, q_len, kv_len)`` bool mask of allowed (query, key) pairs.

    The pattern (a :class:`zoo.pattern.Pattern` or any mask_mod) with causality and padding
    (:func:`zoo.pattern.dense_mask`). It is O(n²): used by the ``dense`` reference variant and by tests, never by a
    sub-quadratic kernel. Queries are the last ``q_len`` keys, at ``call.positions``.
    """
    positions = call.positions.to(device) if call.positions is not None else None
    return dense_mask(pattern, call.causal, call.padding_mask, batch, heads, q_len, kv_len, device, positions)


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """Plain softmax attention over the allowed keys; a query with no allowed key outputs zeros.

    ``allowed`` broadcasts against the scores ``(..., q_len, kv_len)``. Scores are computed in fp32.
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = safe_softmax(scores)
    if dropout and training:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v.float()).to(v.dtype)


def safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim that returns zeros (not NaN) for rows that are entirely ``-inf``."""
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    return weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = -2, value: float = 0.0) -> torch.Tensor:
    """Pad ``x`` along ``dim`` (at the end) to a multiple of ``multiple``."""
    length = x.shape[dim]
    extra = (-length) % multiple
    if extra == 0:
        return x
    dim = dim % x.dim()
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return F.pad(x, pad, value=value)


def sdpa_real_tokens_first(q, k, v, real: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """Torch SDPA over a padded batch (q_len == kv_len) without an n x n mask: the real tokens of every row are
    moved to the front in order (``real`` (B, n) bool, any pattern of holes), one SDPA runs on the first
    ``max(real tokens)`` slots (causal: ``is_causal``, the real tokens keep their order; bidirectional: a
    (B, 1, 1, slots) key mask) and the rows are scattered back. Padded query rows are zero. Inside a compiled graph
    every slot is kept (the longest row's length would be read on the host and break the graph)."""
    lengths = real.sum(-1)
    order = torch.argsort((~real).to(torch.uint8), dim=-1, stable=True)  # reals first
    if not torch.compiler.is_compiling():
        order = order[:, : int(lengths.max())]
    index = order[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1])
    front = [x.gather(2, index) for x in (q, k, v)]
    key_real = None
    if not call.causal:  # causal: a real query only sees earlier slots, all real
        key_real = (torch.arange(order.shape[1], device=q.device) < lengths[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        *front, attn_mask=key_real, dropout_p=call.effective_dropout, is_causal=call.causal,
        scale=call.scaling,
    )
    return q.new_zeros(q.shape).scatter(2, index, out)


def in_head_groups(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``fn(q, k, v)`` -> (B, H, Nq, Dv) run on groups of heads holding at most ``limits.HEAD_GROUP_ELEMENTS`` per
    tensor.

    For kernels made of many element-wise passes (feature maps, normalization): on tensors that fit the cache
    those passes cost a fraction of what they cost streaming whole-sequence tensors through memory. ``split``
    (not slicing) keeps the backward to one concatenation per input.
    """
    per_head = q.shape[0] * max(q.shape[-2] * q.shape[-1], k.shape[-2] * max(k.shape[-1], v.shape[-1]))
    step = max(1, limits.HEAD_GROUP_ELEMENTS // per_head)
    if step >= q.shape[1]:
        return fn(q, k, v)
    groups = zip(q.split(step, dim=1), k.split(step, dim=1), v.split(step, dim=1), strict=True)
    return torch.cat([fn(*group) for group in groups], dim=1)
