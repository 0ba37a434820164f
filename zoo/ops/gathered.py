"""Attention of query blocks over gathered key blocks (BigBird's kernel), chunk by chunk.

Each entry (a block of Q consecutive queries of one batch row and head) attends to R key blocks named by an
index. Gathering them all at once materializes R copies of the keys and values (and as much again for their
gradients) in fresh allocations; on CPU that time goes to page faults rather than to arithmetic. The CPU path
here works on chunks of entries whose gathered keys fit a small buffer: the forward gathers a chunk, runs the
flash kernel and keeps only the output and log-sum-exp; the backward gathers the chunk again (recompute, as
FlashAttention does), runs the flash backward and scatter-adds the key and value gradients. Extra memory is
O(chunk), not O(n · R · block). Elsewhere (CUDA, dropout, other dtypes): one gather and one SDPA call.
"""

from __future__ import annotations

import torch

from zoo.ops.blocked import rows_attention
from zoo.ops.flash import additive_mask, flash_available, flash_backward, flash_forward
from zoo.variant import AttentionCall

# Gathered key elements per chunk: 4 MB in fp32, far below glibc's 32 MB mmap threshold, so the chunk buffers are
# reused from the heap instead of being page-faulted afresh on every call.
GATHER_CHUNK_ELEMENTS = 2**20


def gathered_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    index: torch.Tensor,
    allowed: torch.Tensor | None,
    call: AttentionCall,
) -> torch.Tensor:
    """Softmax attention of each query entry over its gathered key blocks. Returns (E, Q, Dv).

    q (E, Q, D); k_blocks (Nb, block, D) and v_blocks (Nb, block, Dv): all key blocks, flat; index (E, R) long:
    the key blocks of each entry; allowed: bool (E|1, Q|1, R·block) or None. A query with no allowed key
    outputs zeros.
    """
    dropout = call.dropout if call.training else 0.0
    if flash_available(q, dropout):
        return _ChunkedGatheredFlash.apply(q, k_blocks, v_blocks, index, allowed, call.scaling)
    keys, values = (x.index_select(0, index.flatten()).view(index.shape[0], 1, -1, x.shape[-1])
                    for x in (k_blocks, v_blocks))
    return rows_attention(q[:, None], keys, values, None if allowed is None else allowed[:, None], call)[:, 0]


def entries_per_chunk(index: torch.Tensor, block: int, dim: int) -> int:
    return max(1, GATHER_CHUNK_ELEMENTS // (index.shape[1] * block * dim))


def _chunk(k_blocks, v_blocks, index, allowed, start: int, stop: int, dtype):
    """Gathered keys and values (e, 1, R·block, D) of entries [start, stop) and their additive mask."""
    rows = index[start:stop].flatten()
    keys, values = (x.index_select(0, rows).view(stop - start, 1, -1, x.shape[-1]) for x in (k_blocks, v_blocks))
    mask = None
    if allowed is not None:
        mask = additive_mask(allowed if allowed.shape[0] == 1 else allowed[start:stop], dtype)[:, None]
    return keys, values, mask


class _ChunkedGatheredFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_blocks, v_blocks, index, allowed, scale):
        step = entries_per_chunk(index, k_blocks.shape[1], k_blocks.shape[2])
        outs, lses = [], []
        for start in range(0, index.shape[0], step):
            stop = min(start + step, index.shape[0])
            keys, values, mask = _chunk(k_blocks, v_blocks, index, allowed, start, stop, q.dtype)
            out, lse = flash_forward(q[start:stop, None], keys, values, mask, scale)
            outs.append(out[:, 0])
            lses.append(lse[:, 0])
        out, lse = torch.cat(outs), torch.cat(lses)
        ctx.scale, ctx.step = scale, step
        ctx.save_for_backward(q, k_blocks, v_blocks, index, allowed, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_blocks, v_blocks, index, allowed, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_q = torch.empty_like(q)
        grad_k, grad_v = torch.zeros_like(k_blocks), torch.zeros_like(v_blocks)
        for start in range(0, index.shape[0], ctx.step):
            stop = min(start + ctx.step, index.shape[0])
            keys, values, mask = _chunk(k_blocks, v_blocks, index, allowed, start, stop, q.dtype)
            rows = slice(start, stop)
            gq, gk, gv = flash_backward(grad_out[rows, None], q[rows, None], keys, values, out[rows, None],
                                        lse[rows, None], mask, ctx.scale)
            grad_q[rows] = gq[:, 0]
            flat = index[rows].flatten()
            grad_k.index_add_(0, flat, gk.reshape(-1, *k_blocks.shape[1:]))
            grad_v.index_add_(0, flat, gv.reshape(-1, *v_blocks.shape[1:]))
        return grad_q, grad_k, grad_v, None, None, None
