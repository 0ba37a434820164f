"""Softmax attention over a union of key sets ("parts") with ONE softmax per query.

For sparse patterns that are the union of structures one blocked key set cannot hold (a local band and a strided
set). Each part lays the n queries out in its own groups with its keys and an ``allowed`` mask (:class:`KeyPart`), or
as entries over gathered key blocks (:class:`GatheredPart`); parts must not share a (query, key) pair. On CPU each
part runs the flash kernel and the parts merge through their log-sum-exps (exact joint gradient); elsewhere the
scores are materialized per group. A query with no allowed key in any part outputs zeros.

Layouts, kernels and dropout: docs/notes/internals.md#union
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zoo.call import AttentionCall
from zoo.ops.dropout import Dropout, attention_backward, attention_forward
from zoo.ops.flash import additive_mask, flash_available
from zoo.ops.gathered import Allowed, gather_all, gathered_backward, gathered_forward, mask_of


@dataclass
class KeyPart:
    """One key set of a union: queries ``q`` (B, H, G, Q, D), keys/values (B, H, G, K, D), ``allowed`` bool
    broadcastable to (B, 1, G, Q, K); ``transposed``: token ``s·G + g`` sits at ``[g, s]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    allowed: torch.Tensor
    transposed: bool = False


@dataclass
class GatheredPart:
    """A key set given as gathered key blocks (see :func:`zoo.ops.gathered_attention`): entries ``q`` (E, Q, D)
    ordered (batch, head, group), token ``g·Q + s`` at entry g, row s; ``k_blocks``/``v_blocks`` (Nb, block, D);
    ``index`` (E, R); ``allowed`` a mask (E|1, Q|1, R·block) or a function of an entry range."""

    q: torch.Tensor
    k_blocks: torch.Tensor
    v_blocks: torch.Tensor
    index: torch.Tensor
    allowed: Allowed
    batch_heads: tuple[int, int]

    def as_key_part(self) -> KeyPart:
        """All entries' keys gathered at once, as a :class:`KeyPart` (the materialized path)."""
        b, h = self.batch_heads
        keys, values = (x.view(b, h, -1, *x.shape[1:]) for x in gather_all(self.k_blocks, self.v_blocks, self.index))
        allowed = mask_of(self.allowed, 0, self.index.shape[0])
        if allowed is None:
            allowed = torch.ones(1, 1, 1, dtype=torch.bool, device=self.q.device)
        groups = (1, 1, 1) if allowed.shape[0] == 1 else (b, h, -1)  # a shared mask stays shared
        allowed = allowed.view(*groups, *allowed.shape[1:])
        return KeyPart(self.q.view(b, h, -1, *self.q.shape[1:]), keys, values, allowed)


def band_part(q, k, v, key_real: torch.Tensor, width: int, causal: bool, block: int) -> GatheredPart:
    """Sliding window as a part: query i sees key j when ``|i − j| < width`` (causal: ``0 ≤ i − j < width``).

    q/k/v (B, H, n, D) with n a multiple of ``block``; ``key_real`` (B|1, n) bool, False for padding. Each query
    block gathers the key blocks within ``width − 1`` positions on each side; the mask of an entry range is
    computed when that range runs, never for the whole sequence.
    """
    batch, heads, n, _ = q.shape
    groups = n // block
    side_blocks = min(math.ceil((width - 1) / block), groups - 1)  # key blocks on each side, never past the end
    relative = torch.arange(-side_blocks, 1 if causal else side_blocks + 1, device=q.device)  # around a query block
    within = torch.arange(block, device=q.device)

    def key_blocks(entries: torch.Tensor) -> torch.Tensor:  # unclamped key block numbers (e, R)
        return (entries % groups)[:, None] + relative[None, :]

    # Key offset from the query inside a block row is the same for every query block: one (Q, K) band mask.
    offset = within[:, None] - (relative[:, None] * block + within).flatten()[None, :]
    in_band = (offset < width) & ((offset >= 0) if causal else (offset > -width))

    def allowed(start: int, stop: int) -> torch.Tensor:
        entries = torch.arange(start, stop, device=q.device)
        key_pos = (key_blocks(entries)[..., None] * block + within).flatten(1)  # (e, K)
        rows = (entries // (groups * heads)) if key_real.shape[0] > 1 else torch.zeros_like(entries)
        real = key_real[rows[:, None], key_pos.clamp(0, n - 1)] & (key_pos >= 0) & (key_pos < n)
        if torch.compiler.is_compiling():  # no host read per chunk inside a compiled graph
            return in_band[None] & real[:, None, :]
        return in_band[None] if bool(real.all()) else in_band[None] & real[:, None, :]

    entries = torch.arange(batch * heads * groups, device=q.device)
    index = key_blocks(entries).clamp(0, groups - 1) + (entries // groups * groups)[:, None]
    flat = (x.reshape(batch * heads * groups, block, x.shape[-1]) for x in (q, k, v))
    return GatheredPart(*flat, index, allowed, (batch, heads))


def union_attention(parts: list[KeyPart | GatheredPart], call: AttentionCall) -> torch.Tensor:
    """(B, H, n, D): softmax attention of every query over the union of its parts' allowed keys."""
    if flash_available(parts[0].q):
        specs = tuple(_spec(part) for part in parts)
        tensors = [x for part in parts for x in _tensors(part)]
        return _FlashUnion.apply(call.scaling, specs, Dropout.of(call), *tensors)
    parts = [part.as_key_part() if isinstance(part, GatheredPart) else part for part in parts]
    return _materialized_union(parts, call.scaling, call.effective_dropout)


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


def _per_batch(fn, mask: torch.Tensor, dropout: Dropout, *tensors: torch.Tensor):
    """Run a 4-D flash op ``fn(*tensors, mask, dropout)`` on 5-D (B, H, G, Q|K, D) tensors: B and H merged when
    the mask has no batch dim, else one call per batch row (the mask must broadcast over the first dim)."""
    if mask.shape[0] == 1:
        results = fn(*(x.flatten(0, 1) for x in tensors), mask[0], dropout)
        return [r.unflatten(0, tensors[0].shape[:2]) for r in results]
    rows = [fn(*(x[b] for x in tensors), mask[b], dropout.child(b)) for b in range(tensors[0].shape[0])]
    return [torch.stack(column) for column in zip(*rows, strict=True)]


def _tensors(part) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (part.q, part.k_blocks, part.v_blocks) if isinstance(part, GatheredPart) else (part.q, part.k, part.v)


def _spec(part):
    if isinstance(part, GatheredPart):
        return _GatheredSpec(part.index, part.allowed, part.batch_heads)
    return _ViewSpec(part.transposed, part.q.shape[2], part.q.shape[3], additive_mask(part.allowed, part.q.dtype))


@dataclass
class _ViewSpec:
    """A :class:`KeyPart`: one flash call over its views (per batch row when the mask has one)."""

    transposed: bool
    groups: int
    per_group: int
    mask: torch.Tensor

    def forward(self, q, k, v, scale, dropout: Dropout):
        out, lse = _per_batch(lambda *x: attention_forward(*x[:-1], scale, x[-1]), self.mask, dropout, q, k, v)
        empty = (self.mask == float("-inf")).all(-1)  # the kernel reports lse 0 for a fully masked row
        return to_tokens(out, self.transposed), to_tokens(lse.masked_fill(empty, float("-inf")), self.transposed)

    def backward(self, grad, merged, total, q, k, v, scale, dropout: Dropout):
        grad, merged, total = (from_tokens(x, self.transposed, self.groups, self.per_group)
                               for x in (grad, merged, total))
        return _per_batch(lambda *x: attention_backward(*x[:-1], scale, x[-1]), self.mask, dropout,
                          grad, q, k, v, merged, total)


@dataclass
class _GatheredSpec:
    """A :class:`GatheredPart`: chunked gathered flash calls (:mod:`zoo.ops.gathered`)."""

    index: torch.Tensor
    allowed: Allowed
    batch_heads: tuple[int, int]

    def forward(self, q, k_blocks, v_blocks, scale, dropout: Dropout):
        out, lse = gathered_forward(q, k_blocks, v_blocks, self.index, self.allowed, scale, float("-inf"), dropout)
        return out.view(*self.batch_heads, -1, out.shape[-1]), lse.view(*self.batch_heads, -1)

    def backward(self, grad, merged, total, q, k_blocks, v_blocks, scale, dropout: Dropout):
        grad, merged = (x.reshape(*q.shape[:2], x.shape[-1]) for x in (grad, merged))
        total = total.reshape(q.shape[:2])
        return gathered_backward(grad, q, k_blocks, v_blocks, self.index, self.allowed, merged, total, scale,
                                 dropout)


def _merge(outs, lses, total) -> torch.Tensor:
    """Σ_parts out · exp(lse − total), accumulated in place into the first part's output: the parts' outputs are
    fresh tensors of the kernels, and a full-size temporary per part (plus ``sum``'s copy) cost ~10x more (16K)."""
    weight = [torch.exp(lse - total)[..., None] for lse in lses]
    merged = outs[0].mul_(weight[0].to(outs[0].dtype))
    for out, w in zip(outs[1:], weight[1:], strict=True):
        merged.addcmul_(out, w.to(out.dtype))
    return merged


class _FlashUnion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale, specs, dropout, *tensors):
        outs, lses = zip(*(spec.forward(*tensors[3 * i : 3 * i + 3], scale, dropout.child(i))
                           for i, spec in enumerate(specs)), strict=True)
        total = torch.logsumexp(torch.stack(lses), 0)
        total = total.masked_fill(torch.isinf(total), 0.0)  # no key at all: zeros out, zero gradients
        merged = _merge(outs, lses, total)
        ctx.scale, ctx.specs, ctx.dropout = scale, specs, dropout
        ctx.save_for_backward(merged, total, *tensors)
        return merged

    @staticmethod
    def backward(ctx, grad_merged):
        merged, total, *tensors = ctx.saved_tensors
        grads = []
        for i, spec in enumerate(ctx.specs):
            grads += spec.backward(grad_merged, merged, total, *tensors[3 * i : 3 * i + 3], ctx.scale,
                                   ctx.dropout.child(i))
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
