"""Attention of query blocks over gathered key blocks (BigBird's kernel, the sliding-window band), chunk by chunk.

Each entry (a block of Q consecutive queries of one batch row and head) attends to R key blocks named by an
index. Gathering them all at once materializes R copies of the keys and values (and as much again for their
gradients) in fresh allocations; on CPU that time goes to page faults and cache misses rather than to
arithmetic. The CPU path here works on chunks of entries whose gathered keys fit a small buffer: the forward
gathers a chunk (into two buffers reused by every chunk), runs the flash kernel and keeps only the output and
log-sum-exp; the backward gathers the chunk again (recompute, as FlashAttention does), runs the flash backward
and scatter-adds the key and value gradients. Extra memory is O(chunk), not O(n · R · block). Under attention
dropout the chunks run :mod:`zoo.ops.dropout`'s kernels instead of the flash ones (masks redrawn from a seed in
the backward, never stored). Elsewhere (CUDA, other dtypes): chunks of entries, each one gather and one SDPA call,
recomputed in the backward (:func:`device_chunks`).

``allowed`` is a bool tensor broadcastable to (E, Q, R·block) given as (E|1, Q|1, R·block), or a function
``allowed(start, stop)`` returning that mask for entries [start, stop) (so a mask that is cheap to compute
never exists whole), or None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from zoo.call import AttentionCall
from zoo.ops import limits
from zoo.ops.blocked import rows_attention
from zoo.ops.dropout import NO_DROPOUT, Dropout, attention_backward, attention_forward
from zoo.ops.flash import additive_mask, flash_available

Allowed = torch.Tensor | Callable[[int, int], torch.Tensor] | None


def key_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x (B, H, n, D) as rows: (a (R, D) view, (B, H) long: the row of x[b, h, 0], the rows between positions), so
    that ``rows.index_select(0, start[b, h] + s * step)`` reads x[b, h, s] in place, whether x is a cache's view of a
    larger buffer (:class:`zoo.cache.GrowingLayer`) or heads transposed from (B, n, H, D): indexing costs O(rows
    read) where ``x.reshape(-1, D)`` would copy every key. Copies only when x's rows are not D-aligned."""
    dim = x.shape[-1]
    if x.stride(-1) != 1 or any(stride % dim for stride in x.stride()[:3]):
        x = x.contiguous()
    strides = [stride // dim for stride in x.stride()[:3]]
    count = sum(stride * (size - 1) for stride, size in zip(strides, x.shape[:3], strict=True)) + 1
    start = (torch.arange(x.shape[0], device=x.device)[:, None] * strides[0]
             + torch.arange(x.shape[1], device=x.device) * strides[1])
    return x.as_strided((count, dim), (dim, 1)), start, strides[2]


def device_chunks(items: int, elements_per_item: int, entries_per_item: int = 1) -> list[slice]:
    """Ranges of items (each ``entries_per_item`` SDPA entries) of at most ``limits.DEVICE_CHUNK_ENTRIES`` entries and
    about ``limits.DEVICE_CHUNK_ELEMENTS`` gathered elements."""
    step = min(limits.DEVICE_CHUNK_ENTRIES // entries_per_item,
               limits.DEVICE_CHUNK_ELEMENTS // max(1, elements_per_item))
    step = max(1, step)
    return [slice(start, min(start + step, items)) for start in range(0, items, step)]


def recomputed(fn, *args):
    """``fn(*args)``, its activations recomputed in the backward when a tensor argument needs a gradient."""
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def gathered_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    index: torch.Tensor,
    allowed: Allowed,
    call: AttentionCall,
) -> torch.Tensor:
    """Softmax attention of each query entry over its gathered key blocks. Returns (E, Q, Dv).

    q (E, Q, D); k_blocks (Nb, block, D) and v_blocks (Nb, block, Dv): all key blocks, flat; index (E, R) long:
    the key blocks of each entry. A query with no allowed key outputs zeros.
    """
    if flash_available(q):
        return _ChunkedGatheredFlash.apply(q, k_blocks, v_blocks, index, allowed, call.scaling, Dropout.of(call))
    per_entry = index.shape[1] * k_blocks.shape[1] * max(k_blocks.shape[2], q.shape[1])
    return torch.cat([
        recomputed(_gathered_sdpa, q[rows], k_blocks, v_blocks, index[rows], mask_of(allowed, rows.start, rows.stop),
                   call)
        for rows in device_chunks(index.shape[0], per_entry)
    ])


def _gathered_sdpa(q, k_blocks, v_blocks, index, mask, call: AttentionCall) -> torch.Tensor:
    """Entries q (e, Q, D) over their gathered key blocks in one SDPA call (mask (e|1, Q|1, K) or None)."""
    keys, values = gather_all(k_blocks, v_blocks, index)
    mask = None if mask is None else mask[:, None]
    return rows_attention(q[:, None], keys[:, None], values[:, None], mask, call)[:, 0]


def gather_all(k_blocks: torch.Tensor, v_blocks: torch.Tensor, index: torch.Tensor):
    """Every entry's keys and values at once: (E, R·block, D) each (the non-chunked paths)."""
    return (x.index_select(0, index.flatten()).view(index.shape[0], -1, x.shape[-1]) for x in (k_blocks, v_blocks))


def mask_of(allowed: Allowed, start: int, stop: int) -> torch.Tensor | None:
    """The bool mask (e|1, Q|1, K) of entries [start, stop)."""
    if allowed is None or not isinstance(allowed, torch.Tensor):
        return None if allowed is None else allowed(start, stop)
    return allowed if allowed.shape[0] == 1 else allowed[start:stop]


def gathered_forward(q, k_blocks, v_blocks, index, allowed: Allowed, scale: float, empty_lse: float = 0.0,
                     dropout: Dropout = NO_DROPOUT):
    """Chunked flash forward: (out (E, Q, Dv), lse (E, Q)); rows without any allowed key get ``empty_lse``."""
    outs, lses, buffers = [], [], {}
    for number, (start, stop) in enumerate(_chunks(q, index, k_blocks)):
        keys, values, mask = _chunk(k_blocks, v_blocks, index, allowed, start, stop, q.dtype, buffers)
        out, lse = attention_forward(q[start:stop, None], keys, values, mask, scale, dropout.child(number))
        lse = lse[:, 0]
        if mask is not None and empty_lse != 0.0:
            lse = lse.masked_fill((mask[:, 0] == float("-inf")).all(-1), empty_lse)
        outs.append(out[:, 0])
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def gathered_backward(grad_out, q, k_blocks, v_blocks, index, allowed: Allowed, out, lse, scale: float,
                      dropout: Dropout = NO_DROPOUT):
    """Chunked flash backward given the (possibly merged) output and log-sum-exp: grads of (q, k_blocks, v_blocks)."""
    grad_out = grad_out.contiguous()
    grad_q = torch.empty_like(q)
    grad_k, grad_v = torch.zeros_like(k_blocks), torch.zeros_like(v_blocks)
    buffers = {}
    for number, (start, stop) in enumerate(_chunks(q, index, k_blocks)):
        keys, values, mask = _chunk(k_blocks, v_blocks, index, allowed, start, stop, q.dtype, buffers)
        rows = slice(start, stop)
        gq, gk, gv = attention_backward(grad_out[rows, None], q[rows, None], keys, values, out[rows, None],
                                        lse[rows, None], mask, scale, dropout.child(number))
        grad_q[rows] = gq[:, 0]
        flat = index[rows].flatten()
        grad_k.index_add_(0, flat, gk.reshape(-1, *k_blocks.shape[1:]))
        grad_v.index_add_(0, flat, gv.reshape(-1, *v_blocks.shape[1:]))
    return grad_q, grad_k, grad_v


def _chunks(q: torch.Tensor, index: torch.Tensor, k_blocks: torch.Tensor):
    """Entry ranges whose gathered keys, and whose (Q x K) mask, hold at most ``limits.GATHER_CHUNK_ELEMENTS`` each."""
    keys = index.shape[1] * k_blocks.shape[1]
    step = max(1, limits.GATHER_CHUNK_ELEMENTS // (keys * max(k_blocks.shape[2], q.shape[1])))
    return ((start, min(start + step, index.shape[0])) for start in range(0, index.shape[0], step))


def _chunk(k_blocks, v_blocks, index, allowed: Allowed, start: int, stop: int, dtype, buffers: dict):
    """Gathered keys and values (e, 1, R·block, D) of entries [start, stop) and their additive mask.

    The gathers write into two buffers reused by every chunk of a call (``buffers``), not fresh allocations.
    """
    rows = index[start:stop].flatten()
    gathered = []
    for name, x in (("keys", k_blocks), ("values", v_blocks)):
        if torch.compiler.is_compiling():  # a graph plans its own memory (and export refuses out= with autograd)
            gathered.append(x.index_select(0, rows).view(stop - start, 1, -1, x.shape[-1]))
            continue
        buffer = buffers.get(name)
        if buffer is None or buffer.shape[0] < rows.numel():  # the first chunk is the largest
            buffer = buffers[name] = x.new_empty(rows.numel(), *x.shape[1:])
        out = buffer[: rows.numel()]
        torch.index_select(x, 0, rows, out=out)
        gathered.append(out.view(stop - start, 1, -1, x.shape[-1]))
    mask = mask_of(allowed, start, stop)
    return *gathered, None if mask is None else additive_mask(mask, dtype)[:, None]


class _ChunkedGatheredFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_blocks, v_blocks, index, allowed, scale, dropout):
        out, lse = gathered_forward(q, k_blocks, v_blocks, index, allowed, scale, dropout=dropout)
        ctx.scale, ctx.allowed, ctx.dropout = scale, allowed, dropout
        ctx.save_for_backward(q, k_blocks, v_blocks, index, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_blocks, v_blocks, index, out, lse = ctx.saved_tensors
        grads = gathered_backward(grad_out, q, k_blocks, v_blocks, index, ctx.allowed, out, lse, ctx.scale,
                                  ctx.dropout)
        return (*grads, None, None, None, None)
