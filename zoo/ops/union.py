"""Softmax attention over a union of key sets ("parts") with ONE softmax per query.

Some sparse patterns are the union of two structures that do not fit one blocked key set: e.g. a local band
(consecutive queries share keys) and a strided set (queries of one residue class mod l share keys). Each
part lays the same n queries out in its own groups -- ``(B, H, G, Q, D)``, token ``g·Q + s`` at ``[g, s]``,
or ``s·G + g`` when ``transposed`` -- with keys ``(B, H, G, K, D)`` (views: band views, expanded columns) and a
bool ``allowed`` mask broadcastable to ``(B, 1, G, Q, K)``. Parts must not share a (query, key) pair.

On CPU without dropout each part runs the flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``,
what ``scaled_dot_product_attention`` uses for 4-D inputs) and the parts merge through their log-sum-exps,
as ring attention does; the backward calls the flash backward of each part with the merged output and
log-sum-exp, which gives the exact gradient of the joint softmax. Elsewhere (CUDA, dropout) the parts'
scores are materialized per group, O(n · keys per query) memory, sharing one shift and one denominator.
A query with no allowed key in any part outputs zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zoo.ops.blocked import band_blocks, band_positions, split_blocks
from zoo.ops.flash import additive_mask, flash_available, flash_backward, flash_forward
from zoo.variant import AttentionCall


@dataclass
class KeyPart:
    """One key set of a union: queries ``q`` (B, H, G, Q, D), keys/values (B, H, G, K, D), ``allowed`` bool
    broadcastable to (B, 1, G, Q, K); ``transposed``: token ``s·G + g`` sits at ``[g, s]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    allowed: torch.Tensor
    transposed: bool = False


def band_part(q, k, v, key_real: torch.Tensor, width: int, causal: bool, block: int) -> KeyPart:
    """Sliding window as a part: query i sees key j when ``|i − j| < width`` (causal: ``0 ≤ i − j < width``).

    q/k/v (B, H, n, D) with n a multiple of ``block``; ``key_real`` (B|1, n) bool, False for padding. Query
    blocks of ``block`` see a band view of ``width − 1`` keys (rounded up to blocks) on each side.
    """
    n = q.shape[-2]
    reach = math.ceil((width - 1) / block) * block
    after = 0 if causal else reach
    positions = band_positions(n // block, block, reach, after, device=q.device)  # (G, K)
    offset = torch.arange(n, device=q.device).view(-1, block, 1) - positions[:, None, :]  # i - j: (G, block, K)
    in_band = (offset < width) & ((offset >= 0) if causal else (offset > -width))
    band_real = F.pad(key_real, (reach, after), value=False)[:, positions + reach]  # (B|1, G, K)
    return KeyPart(
        split_blocks(q, block), band_blocks(k, block, reach, after), band_blocks(v, block, reach, after),
        in_band[None, None] & band_real[:, None, :, None, :],
    )


def union_attention(parts: list[KeyPart], call: AttentionCall) -> torch.Tensor:
    """(B, H, n, D): softmax attention of every query over the union of its parts' allowed keys."""
    dropout = call.dropout if call.training else 0.0
    q = parts[0].q
    if flash_available(q, dropout):
        layouts = tuple((part.transposed, part.q.shape[2], part.q.shape[3]) for part in parts)
        masks = tuple(additive_mask(part.allowed, q.dtype) for part in parts)
        tensors = [x for part in parts for x in (part.q, part.k, part.v)]
        return _FlashUnion.apply(call.scaling, layouts, masks, *tensors)
    return _materialized_union(parts, call.scaling, dropout)


# -------------------------------------------------------------------------------------------------------
# layouts


def to_tokens(x: torch.Tensor, transposed: bool) -> torch.Tensor:
    """(B, H, G, Q, *rest) -> (B, H, G·Q, *rest) in token order."""
    if transposed:
        x = x.transpose(2, 3)
    return x.reshape(x.shape[0], x.shape[1], -1, *x.shape[4:])


def from_tokens(x: torch.Tensor, transposed: bool, groups: int, per_group: int) -> torch.Tensor:
    """(B, H, n, *rest) -> (B, H, G, Q, *rest): the inverse of :func:`to_tokens` (a view when possible)."""
    if transposed:
        return x.reshape(x.shape[0], x.shape[1], per_group, groups, *x.shape[3:]).transpose(2, 3)
    return x.reshape(x.shape[0], x.shape[1], groups, per_group, *x.shape[3:])


# -------------------------------------------------------------------------------------------------------
# CPU: flash kernel per part, merged by log-sum-exp


def _per_batch(fn, mask: torch.Tensor, *tensors: torch.Tensor):
    """Run a 4-D flash op on 5-D (B, H, G, Q|K, D) tensors: B and H merged when the mask has no batch dim,
    else one call per batch row (the mask must broadcast over the first dim)."""
    if mask.shape[0] == 1:
        results = fn(*(x.flatten(0, 1) for x in tensors), mask[0])
        return [r.unflatten(0, tensors[0].shape[:2]) for r in results]
    rows = [fn(*(x[b] for x in tensors), mask[b]) for b in range(tensors[0].shape[0])]
    return [torch.stack(column) for column in zip(*rows, strict=True)]


class _FlashUnion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale, layouts, masks, *tensors):
        def flash(q4, k4, v4, mask4):
            return flash_forward(q4, k4, v4, mask4, scale)

        outs, lses = [], []
        for i, ((transposed, _, _), mask) in enumerate(zip(layouts, masks, strict=True)):
            q, k, v = tensors[3 * i : 3 * i + 3]
            out, lse = _per_batch(flash, mask, q, k, v)
            empty = (mask == float("-inf")).all(-1)  # the kernel reports lse 0 for a fully masked row
            outs.append(to_tokens(out, transposed))
            lses.append(to_tokens(lse.masked_fill(empty, float("-inf")), transposed))
        total = torch.logsumexp(torch.stack(lses), 0)
        total = total.masked_fill(torch.isinf(total), 0.0)  # no key at all: zeros out, zero gradients
        merged = sum(out * torch.exp(lse - total)[..., None].to(out.dtype) for out, lse in zip(outs, lses, strict=True))
        ctx.scale, ctx.layouts, ctx.masks = scale, layouts, masks
        ctx.save_for_backward(merged, total, *tensors)
        return merged

    @staticmethod
    def backward(ctx, grad_merged):
        merged, total, *tensors = ctx.saved_tensors

        def backward_part(grad4, q4, k4, v4, out4, lse4, mask4):
            return flash_backward(grad4, q4, k4, v4, out4, lse4, mask4, ctx.scale)

        grads = []
        for i, ((transposed, groups, per_group), mask) in enumerate(zip(ctx.layouts, ctx.masks, strict=True)):
            merged_part = [from_tokens(x, transposed, groups, per_group) for x in (grad_merged, merged, total)]
            q, k, v = tensors[3 * i : 3 * i + 3]
            grads += _per_batch(backward_part, mask, merged_part[0], q, k, v, merged_part[1], merged_part[2])
        return (None, None, None, *grads)


# -------------------------------------------------------------------------------------------------------
# elsewhere: materialized per-group scores, one shift and one denominator


def _materialized_union(parts: list[KeyPart], scale: float, dropout: float) -> torch.Tensor:
    scores = [
        torch.matmul(part.q, part.k.transpose(-1, -2)).mul_(scale).masked_fill_(~part.allowed, float("-inf"))
        for part in parts
    ]
    with torch.no_grad():  # any per-query constant works as the softmax shift; the max keeps exp() in range
        shift = torch.stack([to_tokens(s.amax(-1), p.transposed) for s, p in zip(scores, parts, strict=True)]).amax(0)
        shift = shift.masked_fill(torch.isinf(shift), 0.0)
    weights, denominator, numerator = [], 0, 0
    for s, part in zip(scores, parts, strict=True):
        groups, per_group = part.q.shape[2:4]
        w = s.sub_(from_tokens(shift, part.transposed, groups, per_group)[..., None]).exp_()
        denominator = denominator + to_tokens(w.sum(-1), part.transposed)
        weights.append(F.dropout(w, dropout) if dropout else w)  # drop probabilities, keep the denominator
    for w, part in zip(weights, parts, strict=True):
        numerator = numerator + to_tokens(torch.matmul(w, part.v), part.transposed)
    return numerator / denominator.clamp_min(torch.finfo(denominator.dtype).tiny)[..., None]
