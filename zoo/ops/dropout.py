"""Attention dropout inside the chunked CPU kernels, with nothing of size n × (keys per query) kept.

torch's CPU flash kernel takes no dropout mask, so under dropout the chunked kernels call :func:`dropout_forward`
and :func:`dropout_backward` (same shapes and conventions as :mod:`zoo.ops.flash`), one chunk of at most
``limits.DROPOUT_CHUNK_ELEMENTS`` scores at a time. Dropout acts on the final normalised probabilities, so parts
merged through their log-sum-exps drop the joint softmax exactly. Masks are never stored: each chunk's mask is drawn
from a seed of the call (reproducible with ``torch.manual_seed``) and redrawn in the backward; ``p`` is rounded to a
multiple of 2^-16 and kept values are scaled by ``1 / (1 − p_rounded)``.

Derivation, cost and comparison with FlashAttention: docs/notes/internals.md#dropout
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from zoo.call import AttentionCall
from zoo.ops import limits
from zoo.ops.flash import flash_backward, flash_forward

# Groups per chunk are a multiple of this when at least that many fit: torch's CPU bmm splits a batch across its
# threads, and 3 groups on 2 threads left one idle half the time (1.24x slower at 16K, measured). A constant, not
# the thread count: the chunks (hence the masks) must not depend on the threads of the backward.
GROUP_MULTIPLE = 4
KEEP_BITS = 16
LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)


@dataclass(frozen=True)
class Dropout:
    """The dropout of one kernel call: probability ``p``, the call's ``seed`` and the ``path`` naming a chunk
    inside it (part, chunk...). ``p == 0`` (:data:`NO_DROPOUT`) selects the flash kernels."""

    p: float = 0.0
    seed: int = 0
    path: tuple[int, ...] = ()

    @classmethod
    def of(cls, call: AttentionCall) -> Dropout:
        """The call's dropout: a fresh seed from torch's default generator in training with p > 0."""
        p = call.effective_dropout
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"attention-zoo: attention dropout must be in [0, 1], got {p}.")
        if p == 0.0:
            return NO_DROPOUT
        return cls(p, int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64)))

    def child(self, *ids: int) -> Dropout:
        """The stream of a sub-problem (a part, a chunk, a batch row)."""
        return self if self.p == 0.0 else replace(self, path=self.path + ids)

    @property
    def drop_units(self) -> int:
        """Dropped values out of 2^16 random values."""
        return round(self.p * 2**KEEP_BITS)

    @property
    def keep_scale(self) -> float:
        """1 / (1 − p_rounded); 0 when everything is dropped."""
        keep = 1.0 - self.drop_units / 2**KEEP_BITS
        return 0.0 if keep == 0.0 else 1.0 / keep

    def keep_mask(self, shape: tuple[int, ...], buffer: np.ndarray | None = None) -> torch.Tensor:
        """fp32 keep decisions (1 kept, 0 dropped) of this stream, ``shape`` in row-major order, P(1) = 1 − p_rounded.
        ``buffer``: a float32 array of at least that many elements to write them into (reused across a call's chunks:
        a fresh 4 MB array per chunk costs its page faults, 12% of the mask time at 16K); the mask returned shares its
        memory, so it is valid until the next mask drawn into the same buffer.

        The bits come from numpy's PCG64 seeded by ``SeedSequence(seed, spawn_key=path)`` (independent streams per
        chunk by construction): about 4x cheaper per bit than ``torch.Generator``'s mt19937 here (measured),
        whose draws would cost more than the attention arithmetic. 16 bits per decision, compared by numpy straight
        into fp32 (bool tensors and their conversion cost torch twice as much here).
        """
        count = math.prod(shape)
        if self.drop_units == 0:
            return torch.ones(shape)
        if self.drop_units >= 2**KEEP_BITS:
            return torch.zeros(shape)
        bits = np.random.PCG64(np.random.SeedSequence(self.seed, spawn_key=self.path)).random_raw(-(-count // 4))
        values = bits.view(np.int16)[:count]  # uniform in [-2^15, 2^15)
        threshold = self.drop_units - 2 ** (KEEP_BITS - 1)  # keep when value >= threshold
        keep = np.empty(count, np.float32) if buffer is None or buffer.size < count else buffer[:count]
        np.greater_equal(values, np.int16(threshold), out=keep, casting="unsafe")
        return torch.from_numpy(keep).view(shape)


NO_DROPOUT = Dropout()


# -------------------------------------------------------------------------------------------------------
# the flash wrappers' interface, with dropout


def attention_forward(q, k, v, mask: torch.Tensor | None, scale: float, dropout: Dropout):
    """:func:`zoo.ops.flash.flash_forward`, or :func:`dropout_forward` when ``dropout.p > 0``."""
    if dropout.p == 0.0:
        return flash_forward(q, k, v, mask, scale)
    return dropout_forward(q, k, v, mask, scale, dropout)


def attention_backward(grad, q, k, v, out, lse, mask: torch.Tensor | None, scale: float, dropout: Dropout):
    """:func:`zoo.ops.flash.flash_backward`, or :func:`dropout_backward` when ``dropout.p > 0``."""
    if dropout.p == 0.0:
        return flash_backward(grad, q, k, v, out, lse, mask, scale)
    return dropout_backward(grad, q, k, v, out, lse, mask, scale, dropout)


def dropout_forward(q, k, v, mask: torch.Tensor | None, scale: float, dropout: Dropout):
    """(A, G, Q, D) queries over (A, G, K, D) keys with an additive ``mask`` broadcastable to (A, G, Q, K), dropout
    on the probabilities -> (output (A, G, Q, Dv), log-sum-exp (A, G, Q) fp32, of the undropped scores)."""
    swap = _swapped(q)
    if swap:
        q, k, v, mask = _swap(q, k, v, mask)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1]) if k.shape[-2] == 0 else q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
    buffer = _mask_buffer(q.shape, k.shape[-2])
    for number, (a, groups, rows) in enumerate(_chunks(q.shape, k.shape[-2])):
        keep = dropout.child(number).keep_mask(_chunk_shape(groups, rows, k.shape[-2]), buffer)
        _chunk_forward(q[a, groups, rows], k[a, groups], v[a, groups], _mask_at(mask, a, groups, rows), scale, keep,
                       dropout.keep_scale, out[a, groups, rows], lse[a, groups, rows])
    return (out.transpose(0, 1), lse.transpose(0, 1)) if swap else (out, lse)


def dropout_backward(grad, q, k, v, out, lse, mask: torch.Tensor | None, scale: float, dropout: Dropout):
    """Gradients (q, k, v) of :func:`dropout_forward` given its (possibly merged) ``out`` and ``lse``."""
    swap = _swapped(q)
    if swap:
        q, k, v, mask = _swap(q, k, v, mask)
        grad, out, lse = (x.transpose(0, 1) for x in (grad, out, lse))
    empty = torch.zeros if q.shape[-2] == 0 or k.shape[-2] == 0 else torch.empty
    grad_q, grad_k, grad_v = (empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    buffer = _mask_buffer(q.shape, k.shape[-2])
    for number, (a, groups, rows) in enumerate(_chunks(q.shape, k.shape[-2])):
        keep = dropout.child(number).keep_mask(_chunk_shape(groups, rows, k.shape[-2]), buffer)
        _chunk_backward(
            grad[a, groups, rows], q[a, groups, rows], k[a, groups], v[a, groups], out[a, groups, rows],
            lse[a, groups, rows], _mask_at(mask, a, groups, rows), scale, keep, dropout.keep_scale,
            (grad_q[a, groups, rows], grad_k[a, groups], grad_v[a, groups]), accumulate=rows.start > 0,
        )
    return tuple(x.transpose(0, 1) for x in (grad_q, grad_k, grad_v)) if swap else (grad_q, grad_k, grad_v)


def _swapped(q: torch.Tensor) -> bool:
    """(E, 1, Q, D) (the gathered chunks' layout) runs as (1, E, Q, D): one batched chunk, not E small ones."""
    return q.shape[1] == 1 and q.shape[0] > 1


def _swap(q, k, v, mask):
    mask = None if mask is None else mask.transpose(0, 1) if mask.dim() == 4 else mask
    return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask


def _chunks(shape: tuple[int, ...], keys: int):
    """(a, group slice, row slice) of chunks: groups batched while a group's (Q, K) scores fit DROPOUT_CHUNK_ELEMENTS,
    else rows of one group (DROPOUT_ROW_CHUNK_FACTOR · DROPOUT_CHUNK_ELEMENTS scores, or one row). A function of the
    shapes only (the backward redraws the same masks)."""
    outer, groups, rows = shape[:3]
    per_group = rows * keys
    if per_group == 0:  # no query or no key: nothing to compute (the callers zero-fill)
        return
    for a in range(outer):
        if per_group <= limits.DROPOUT_CHUNK_ELEMENTS:
            step = limits.DROPOUT_CHUNK_ELEMENTS // per_group
            step = step // GROUP_MULTIPLE * GROUP_MULTIPLE or step
            for start in range(0, groups, step):
                yield a, slice(start, min(start + step, groups)), slice(0, rows)
        else:
            step = max(1, limits.DROPOUT_ROW_CHUNK_FACTOR * limits.DROPOUT_CHUNK_ELEMENTS // keys)
            for group in range(groups):
                for start in range(0, rows, step):
                    yield a, slice(group, group + 1), slice(start, min(start + step, rows))


def _mask_buffer(shape: tuple[int, ...], keys: int) -> np.ndarray:
    """One float32 array for the keep masks of every chunk of a call (the first chunk is the largest)."""
    first = next(_chunks(shape, keys), None)  # None: no chunk at all (an empty input)
    return np.empty(0 if first is None else math.prod(_chunk_shape(*first[1:], keys)), np.float32)


def _chunk_shape(groups: slice, rows: slice, keys: int) -> tuple[int, int, int]:
    return groups.stop - groups.start, rows.stop - rows.start, keys


def _mask_at(mask: torch.Tensor | None, a: int, groups: slice, rows: slice) -> torch.Tensor | None:
    """The (g|1, r|1, K) slice of a mask broadcastable to (A, G, Q, K)."""
    if mask is None:
        return None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    mask = mask[a if mask.shape[0] > 1 else 0]
    mask = mask[groups] if mask.shape[0] > 1 else mask
    return mask[:, rows] if mask.shape[1] > 1 else mask


def _log2_scores(q, k, mask, scale):
    """Scores of one chunk in base 2, (g, r, K) fp32: exp2 is several times cheaper than exp on CPU here, and
    the scale (times log2 e) goes on the queries, not on the scores. Masks are additive 0 / −inf."""
    scores = torch.matmul(q.float() * (scale * LOG2E), k.float().transpose(-1, -2))
    return scores if mask is None else scores.add_(mask)  # (baddbmm with a broadcast mask measured slower)


def _chunk_forward(q, k, v, mask, scale: float, keep: torch.Tensor, keep_scale: float, out, lse) -> None:
    """One chunk's dropped attention into ``out`` (g, r, Dv) and its log-sum-exp into ``lse`` (g, r)."""
    scores = _log2_scores(q, k, mask, scale)
    row_max = scores.amax(-1, keepdim=True)
    row_max.masked_fill_(torch.isinf(row_max), 0.0)  # a fully masked row: exp2(-inf) = 0 everywhere
    weights = scores.sub_(row_max).exp2_()
    total = weights.sum(-1, keepdim=True)
    empty = total == 0
    inverse = total.reciprocal().masked_fill_(empty, 0.0).mul_(keep_scale)
    out.copy_(torch.matmul(weights.mul_(keep), v.float()).mul_(inverse))
    lse.copy_(row_max.add_(total.log2_()).mul_(LN2).masked_fill_(empty, 0.0).squeeze(-1))


def _chunk_backward(grad, q, k, v, out, lse, mask, scale: float, keep: torch.Tensor, keep_scale: float, grads,
                    accumulate: bool) -> None:
    """One chunk's gradients written into (or, ``accumulate``, added to) ``grads`` = (dq, dk, dv) slices.

    dS = P ∘ (keep ∘ dP / (1 − p) − Δ) = kept ∘ dP' − P ∘ Δ with kept = P ∘ keep, dP' = dO Vᵀ / (1 − p),
    Δ = dO · O; dV = keptᵀ dO / (1 − p).
    """
    probs = _log2_scores(q, k, mask, scale).sub_((lse * LOG2E)[..., None]).exp2_()
    delta = (grad.float() * out.float()).sum(-1, keepdim=True)
    grad = grad.float() * keep_scale
    kept = probs * keep
    grad_scores = torch.matmul(grad, v.float().transpose(-1, -2)).mul_(kept).sub_(probs.mul_(delta))
    q_grad, k_grad, v_grad = grads
    q_grad.copy_(torch.matmul(grad_scores, k.float()).mul_(scale))
    for target, left, right in ((k_grad, grad_scores, q.float() * scale), (v_grad, kept, grad)):
        if accumulate or target.dtype != torch.float32 or not target.is_contiguous():
            target.add_(torch.matmul(left.transpose(-1, -2), right)) if accumulate else target.copy_(
                torch.matmul(left.transpose(-1, -2), right))
        else:
            torch.matmul(left.transpose(-1, -2), right, out=target)


# -------------------------------------------------------------------------------------------------------
# one part on its own (global query rows over all keys)


def dropout_attention(q, k, v, allowed: torch.Tensor | None, scale: float, dropout: Dropout) -> torch.Tensor:
    """(B, H, Q, D) over (B, H, K, D), ``allowed`` bool broadcastable to (B, H, Q, K), dropout on the
    probabilities, chunk by chunk in the forward and again in the backward: O(chunk) extra memory."""
    mask = None
    if allowed is not None:
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill_(~allowed, float("-inf"))
    return _DropoutAttention.apply(q, k, v, mask, scale, dropout)


class _DropoutAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, dropout):
        out, lse = dropout_forward(q, k, v, mask, scale, dropout)
        ctx.scale, ctx.dropout = scale, dropout
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        grads = dropout_backward(grad_out.contiguous(), q, k, v, out, lse, mask, ctx.scale, ctx.dropout)
        return (*grads, None, None, None)


# -------------------------------------------------------------------------------------------------------
# debugging: the dense mask of a call


def dropped_probabilities(attend: Callable[[torch.Tensor], torch.Tensor], batch: int, heads: int, kv_len: int):
    """For small n: the dense (batch, heads, q_len, kv_len) probabilities after dropout, ``keep_ij · P_ij / (1 − p)``,
    that ``attend(values)`` uses when called from the current RNG state (which is left as it was).

    Values are the identity, so output row i is query i's dropped probability row. Masks depend on the call's
    seed and the shapes of q and k only, so the same call with real values uses the same mask: tests build the
    dense reference (softmax restricted to the pattern, times keep / (1 − p), times V) from ``result != 0``.
    """
    identity = torch.eye(kv_len).expand(batch, heads, kv_len, kv_len)
    with torch.random.fork_rng(devices=[]):
        return attend(identity)
