"""Attention dropout inside the chunked CPU kernels, with nothing of size n × (keys per query) kept.

torch's CPU flash kernel takes no dropout mask, so under dropout the chunked kernels (:mod:`zoo.ops.gathered`,
:mod:`zoo.ops.union`, the global rows of :func:`zoo.ops.rows_attention`) call :func:`dropout_forward` and
:func:`dropout_backward` instead of :func:`zoo.ops.flash.flash_forward` / ``flash_backward``: same shapes, same
conventions (a fully masked row outputs zeros with log-sum-exp 0), computed one chunk of at most
``CHUNK_ELEMENTS`` scores at a time: scores -> softmax statistics -> keep mask -> P·V.

Dropout acts on the final normalised probabilities, as ``F.dropout(softmax(scores))`` does: a part's output is
``Σ_j keep_ij · exp(s_ij − lse_i) · v_j / (1 − p)``, so parts merged through their log-sum-exps (union
attention) give the dropout of the joint softmax, and the backward with the merged output and log-sum-exp is
its exact gradient (``Δ_i = dO_i · O_i`` still holds with dropout, as in FlashAttention).

Masks are never stored: one seed per call is drawn from torch's default generator (so ``torch.manual_seed``
reproduces a step), and chunk c of part i draws its keep mask from a ``torch.Generator`` seeded from
(seed, i, c); the backward draws it again (recompute, as FlashAttention does). Keep decisions compare 16
random bits with a threshold (four decisions per 64-bit draw: a uniform float per score costs more than the
attention itself on CPU), so the drop probability is ``p`` rounded to a multiple of 2^-16 (FlashAttention on
CUDA rounds to 2^-8) and kept values are scaled by the exact ``1 / (1 − p_rounded)``: the expectation is the
undropped output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from zoo.ops.flash import flash_backward, flash_forward
from zoo.variant import AttentionCall

# Scores per chunk (1 MB in fp32): a chunk's scores, probabilities and mask stay in cache.
CHUNK_ELEMENTS = 2**18
KEEP_BITS = 16
_MASK64 = 2**64 - 1


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
        p = call.dropout if call.training else 0.0
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"attention-zoo: attention dropout must be in [0, 1], got {p}.")
        if p == 0.0:
            return NO_DROPOUT
        return cls(p, int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)))

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

    def generator(self) -> torch.Generator:
        """A CPU generator seeded from (seed, path) (splitmix64 mixing; mt19937 keeps 32 bits of it)."""
        state = self.seed & _MASK64
        for part in self.path:
            state = _splitmix64((state ^ (part & _MASK64)) & _MASK64)
        return torch.Generator().manual_seed(_splitmix64(state) >> 1)

    def keep_mask(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Bool keep decisions of this stream, ``shape`` in row-major order: P(True) = 1 − p_rounded."""
        count = math.prod(shape)
        if self.drop_units >= 2**KEEP_BITS:
            return torch.zeros(shape, dtype=torch.bool)
        words = torch.empty(-(-count // 4), dtype=torch.int64)
        words.random_(-(2**63), 2**63 - 1, generator=self.generator())
        return words.view(torch.int16)[:count].view(shape) >= self.drop_units - 2 ** (KEEP_BITS - 1)


NO_DROPOUT = Dropout()


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


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
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for number, (a, groups, rows) in enumerate(_chunks(q.shape, k.shape[-2])):
        keep = dropout.child(number).keep_mask((_length(groups, q.shape[1]), _length(rows, q.shape[2]), k.shape[-2]))
        out[a, groups, rows], lse[a, groups, rows] = _chunk_forward(
            q[a, groups, rows], k[a, groups], v[a, groups], _mask_at(mask, a, groups, rows), scale, keep,
            dropout.keep_scale,
        )
    return (out.transpose(0, 1), lse.transpose(0, 1)) if swap else (out, lse)


def dropout_backward(grad, q, k, v, out, lse, mask: torch.Tensor | None, scale: float, dropout: Dropout):
    """Gradients (q, k, v) of :func:`dropout_forward` given its (possibly merged) ``out`` and ``lse``."""
    swap = _swapped(q)
    if swap:
        q, k, v, mask = _swap(q, k, v, mask)
        grad, out, lse = (x.transpose(0, 1) for x in (grad, out, lse))
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for number, (a, groups, rows) in enumerate(_chunks(q.shape, k.shape[-2])):
        keep = dropout.child(number).keep_mask((_length(groups, q.shape[1]), _length(rows, q.shape[2]), k.shape[-2]))
        gq, gk, gv = _chunk_backward(
            grad[a, groups, rows], q[a, groups, rows], k[a, groups], v[a, groups], out[a, groups, rows],
            lse[a, groups, rows], _mask_at(mask, a, groups, rows), scale, keep, dropout.keep_scale,
        )
        grad_q[a, groups, rows] = gq
        grad_k[a, groups] += gk
        grad_v[a, groups] += gv
    return tuple(x.transpose(0, 1) for x in (grad_q, grad_k, grad_v)) if swap else (grad_q, grad_k, grad_v)


def _swapped(q: torch.Tensor) -> bool:
    """(E, 1, Q, D) (the gathered chunks' layout) runs as (1, E, Q, D): one batched chunk, not E small ones."""
    return q.shape[1] == 1 and q.shape[0] > 1


def _swap(q, k, v, mask):
    mask = None if mask is None else mask.transpose(0, 1) if mask.dim() == 4 else mask
    return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask


def _chunks(shape: tuple[int, ...], keys: int):
    """(a, group slice, row slice) of chunks of at most CHUNK_ELEMENTS scores: groups batched while a group's
    (Q, K) scores fit, else rows of one group. A function of the shapes only (the backward redraws the same)."""
    outer, groups, rows = shape[:3]
    per_group = rows * keys
    for a in range(outer):
        if per_group <= CHUNK_ELEMENTS:
            step = CHUNK_ELEMENTS // per_group
            for start in range(0, groups, step):
                yield a, slice(start, min(start + step, groups)), slice(None)
        else:
            step = max(1, CHUNK_ELEMENTS // keys)
            for group in range(groups):
                for start in range(0, rows, step):
                    yield a, slice(group, group + 1), slice(start, min(start + step, rows))


def _length(s: slice, size: int) -> int:
    return len(range(*s.indices(size)))


def _mask_at(mask: torch.Tensor | None, a: int, groups: slice, rows: slice) -> torch.Tensor | None:
    """The (g|1, r|1, K) slice of a mask broadcastable to (A, G, Q, K)."""
    if mask is None:
        return None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    mask = mask[a if mask.shape[0] > 1 else 0]
    mask = mask[groups] if mask.shape[0] > 1 else mask
    return mask[:, rows] if mask.shape[1] > 1 else mask


def _scores(q, k, mask, scale):
    """fp32 scaled (and masked) scores (g, r, K) of one chunk."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    return scores if mask is None else scores.add_(mask)


def _chunk_forward(q, k, v, mask, scale: float, keep: torch.Tensor, keep_scale: float):
    scores = _scores(q, k, mask, scale)
    row_max = scores.amax(-1, keepdim=True)
    row_max.masked_fill_(torch.isinf(row_max), 0.0)  # a fully masked row: exp(-inf) = 0 everywhere
    weights = scores.sub_(row_max).exp_()
    total = weights.sum(-1, keepdim=True)
    inverse = total.reciprocal().masked_fill_(total == 0, 0.0).mul_(keep_scale)
    out = torch.matmul(weights.mul_(keep), v.float()).mul_(inverse)
    lse = (row_max + total.log()).squeeze(-1)
    return out.to(v.dtype), lse.masked_fill_(total.squeeze(-1) == 0, 0.0)


def _chunk_backward(grad, q, k, v, out, lse, mask, scale: float, keep: torch.Tensor, keep_scale: float):
    """dS = P ∘ (keep ∘ dP / (1 − p) − Δ), Δ = dO · O; dV = (P ∘ keep)ᵀ dO / (1 − p)."""
    grad = grad.float()
    probs = _scores(q, k, mask, scale).sub_(lse[..., None]).exp_()
    delta = (grad * out.float()).sum(-1, keepdim=True)
    grad = grad * keep_scale
    kept = probs * keep
    grad_v = torch.matmul(kept.transpose(-1, -2), grad)
    grad_scores = torch.matmul(grad, v.float().transpose(-1, -2)).mul_(keep).sub_(delta).mul_(probs)
    grad_q = torch.matmul(grad_scores, k.float()).mul_(scale)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q.float()).mul_(scale)
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


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
