"""DSA's attention over each query's top-k keys as Triton kernels (written here; DeepSeek's sparse kernels and
flash-linear-attention's were read, not copied). Imported only through :mod:`zoo.ops.backends.triton_dsa` (it needs
the ``triton`` package) or by the tests, which run it on the CPU under ``TRITON_INTERPRET=1``.

One program per (query, batch row) walks the heads; for each head it reads the query's selected keys and values in
tiles of ``BLOCK_K`` rows straight from k and v, addressed through the index (no gathered copy), with an online
softmax in fp32. The forward keeps the log-sum-exp per (head, query); with ``WITH_TARGET`` a second pass over the
same rows sums every head's probabilities per selected key (the indexer's KL target, L1-normalised afterwards), so
the loss never gathers the keys again. The backward recomputes the probabilities from the log-sum-exp, writes dq per
query and adds dk, dv into fp32 buffers with atomics (a key is chosen by many queries). Unchosen slots hold -1; a query
with no key outputs zeros (its log-sum-exp is +inf, so every probability of the backward is 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 32  # selected keys per tile


@triton.jit
def _scores(q_row, k_ptr, index_ptr, slot, slots, dim, stride_n, scale, BLOCK_D: tl.constexpr):
    """One tile: (its key rows, which slots hold a key, fp32 scores (-inf where none)) of one query and head."""
    key = tl.load(index_ptr + slot, mask=slot < slots, other=-1)
    ok = key >= 0
    channels = tl.arange(0, BLOCK_D)
    rows = tl.where(ok, key, 0).to(tl.int64)
    keys = tl.load(k_ptr + rows[:, None] * stride_n + channels[None, :], mask=ok[:, None] & (channels[None, :] < dim),
                   other=0.0).to(tl.float32)
    scores = tl.sum(keys * q_row[None, :], 1) * scale
    return rows, ok, tl.where(ok, scores, float("-inf"))


@triton.jit
def _forward(q_ptr, k_ptr, v_ptr, index_ptr, out_ptr, lse_ptr, target_ptr, queries, heads, slots, groups, dim, dim_v,
             stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, scale,
             BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, WITH_TARGET: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    channels, channels_v, within = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK)
    index_row = index_ptr + (b * queries + t) * slots
    for h in range(0, heads):
        q_row = tl.load(q_ptr + b * stride_qb + h * stride_qh + t * dim + channels, mask=channels < dim,
                        other=0.0).to(tl.float32)
        k_head = k_ptr + b * stride_kb + (h // groups) * stride_kh
        v_head = v_ptr + b * stride_vb + (h // groups) * stride_vh
        top = tl.full([], -1.0e30, tl.float32)
        total = tl.zeros([], tl.float32)
        acc = tl.zeros([BLOCK_DV], tl.float32)
        for start in range(0, slots, BLOCK):
            rows, ok, scores = _scores(q_row, k_head, index_row, start + within, slots, dim, dim, scale, BLOCK_D)
            new_top = tl.maximum(top, tl.max(scores, 0))
            shrink = tl.exp(top - new_top)
            p = tl.exp(scores - new_top)
            values = tl.load(v_head + rows[:, None] * dim_v + channels_v[None, :],
                             mask=ok[:, None] & (channels_v[None, :] < dim_v), other=0.0).to(tl.float32)
            acc = acc * shrink + tl.sum(p[:, None] * values, 0)
            total = total * shrink + tl.sum(p, 0)
            top = new_top
        out = acc / tl.maximum(total, 1.0e-30)
        row = (b * heads + h) * queries + t
        tl.store(out_ptr + row * dim_v + channels_v, out.to(out_ptr.dtype.element_ty), mask=channels_v < dim_v)
        tl.store(lse_ptr + row, tl.where(total > 0, top + tl.log(tl.maximum(total, 1.0e-30)), float("inf")))
    if WITH_TARGET:
        for start in range(0, slots, BLOCK):
            summed = tl.zeros([BLOCK], tl.float32)
            for h in range(0, heads):
                q_row = tl.load(q_ptr + b * stride_qb + h * stride_qh + t * dim + channels, mask=channels < dim,
                                other=0.0).to(tl.float32)
                k_head = k_ptr + b * stride_kb + (h // groups) * stride_kh
                _, ok, scores = _scores(q_row, k_head, index_row, start + within, slots, dim, dim, scale, BLOCK_D)
                lse = tl.load(lse_ptr + (b * heads + h) * queries + t)
                summed += tl.where(ok, tl.exp(scores - lse), 0.0)
            tl.store(target_ptr + (b * queries + t) * slots + start + within, summed, mask=start + within < slots)


@triton.jit
def _backward(q_ptr, k_ptr, v_ptr, index_ptr, grad_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, queries, heads,
              slots, groups, dim, dim_v, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, scale,
              BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    channels, channels_v, within = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK)
    index_row = index_ptr + (b * queries + t) * slots
    for h in range(0, heads):
        query_at = b * stride_qb + h * stride_qh + t * dim
        q_row = tl.load(q_ptr + query_at + channels, mask=channels < dim, other=0.0).to(tl.float32)
        row = (b * heads + h) * queries + t
        grad = tl.load(grad_ptr + row * dim_v + channels_v, mask=channels_v < dim_v, other=0.0).to(tl.float32)
        lse, delta = tl.load(lse_ptr + row), tl.load(delta_ptr + row)
        k_at = b * stride_kb + (h // groups) * stride_kh
        v_at = b * stride_vb + (h // groups) * stride_vh
        dq = tl.zeros([BLOCK_D], tl.float32)
        for start in range(0, slots, BLOCK):
            rows, ok, scores = _scores(q_row, k_ptr + k_at, index_row, start + within, slots, dim, dim, scale,
                                       BLOCK_D)
            p = tl.where(ok, tl.exp(scores - lse), 0.0)
            key_mask = ok[:, None] & (channels[None, :] < dim)
            value_mask = ok[:, None] & (channels_v[None, :] < dim_v)
            keys = tl.load(k_ptr + k_at + rows[:, None] * dim + channels[None, :], mask=key_mask,
                           other=0.0).to(tl.float32)
            values = tl.load(v_ptr + v_at + rows[:, None] * dim_v + channels_v[None, :], mask=value_mask,
                             other=0.0).to(tl.float32)
            ds = p * (tl.sum(values * grad[None, :], 1) - delta) * scale
            dq += tl.sum(ds[:, None] * keys, 0)
            tl.atomic_add(dk_ptr + k_at + rows[:, None] * dim + channels[None, :], ds[:, None] * q_row[None, :],
                          mask=key_mask)
            tl.atomic_add(dv_ptr + v_at + rows[:, None] * dim_v + channels_v[None, :], p[:, None] * grad[None, :],
                          mask=value_mask)
        tl.store(dq_ptr + query_at + channels, dq.to(dq_ptr.dtype.element_ty), mask=channels < dim)


def _block(size: int) -> int:
    return max(16, triton.next_power_of_2(size))


def _sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """(groups, dim, dim_v, then the batch and head strides of q, k, v): what both kernels take after the sizes of
    the call, on contiguous tensors."""
    return (q.shape[1] // k.shape[1], q.shape[-1], v.shape[-1], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1))


class TopKAttention(torch.autograd.Function):
    """(B, H, Q, Dv) attention of each query over its selected keys (index (B, Q, k') int32, -1: none), k/v
    (B, H_kv, n, D) with H a multiple of H_kv; also the head-summed, L1-normalised probabilities (B, Q, k') when asked
    (not differentiable), else None."""

    @staticmethod
    def forward(ctx, q, k, v, index, scale: float, with_target: bool):
        q, k, v, index = (x.contiguous() for x in (q, k, v, index))
        batch, heads, queries, _ = q.shape
        slots = index.shape[-1]
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(batch, heads, queries, dtype=torch.float32, device=q.device)
        target = torch.zeros(batch, queries, slots, dtype=torch.float32, device=q.device) if with_target else lse
        sizes = _sizes(q, k, v)
        _forward[(queries, batch)](q, k, v, index, out, lse, target, queries, heads, slots, *sizes, scale,
                                   BLOCK=BLOCK_K, BLOCK_D=_block(q.shape[-1]), BLOCK_DV=_block(v.shape[-1]),
                                   WITH_TARGET=with_target)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, index, out, lse)
        if not with_target:
            return out, None
        target = target / target.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        ctx.mark_non_differentiable(target)
        return out, target

    @staticmethod
    def backward(ctx, grad, _):
        q, k, v, index, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        delta = (grad.float() * out.float()).sum(-1)
        dq = torch.empty_like(q)
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        batch, heads, queries, _ = q.shape
        _backward[(queries, batch)](q, k, v, index, grad, lse, delta, dq, dk, dv, queries, heads, index.shape[-1],
                                    *_sizes(q, k, v), ctx.scale, BLOCK=BLOCK_K, BLOCK_D=_block(q.shape[-1]),
                                    BLOCK_DV=_block(v.shape[-1]))
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def topk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, chosen: torch.Tensor,
                   scale: float, with_target: bool = False):
    """:func:`zoo.ops.dsa.token_attention`'s call on the Triton kernels: q (B, H, Q, D), k/v (B, H_kv, n, D),
    index/chosen (B, Q, k') shared by the heads. Returns (out (B, H, Q, Dv), target (B, Q, k') fp32 or None)."""
    slots = torch.where(chosen, index, -1).to(torch.int32)
    return TopKAttention.apply(q, k, v, slots, float(scale), with_target)
