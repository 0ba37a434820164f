"""Blocked building blocks for sparse variants: query blocks (views), blocks of queries over their own key
sets in one batched ``scaled_dot_product_attention`` call with a broadcast mask, and selected query rows over
all keys (global tokens). Cost O(n · keys_per_block · d); nothing of size n x n is built. Key sets gathered
per block, chunk by chunk, live in :mod:`zoo.ops.gathered`; unions of key sets in :mod:`zoo.ops.union`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.call import AttentionCall
from zoo.ops.dropout import Dropout, dropout_attention
from zoo.ops.flash import flash_available


def split_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, N, D) with N a multiple of ``block`` -> (B, H, N // block, block, D) (a view)."""
    b, h, n, d = x.shape
    return x.view(b, h, n // block, block, d)


def blocked_attention(
    q_blocks: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    allowed: torch.Tensor | None,
    call: AttentionCall,
) -> torch.Tensor:
    """Softmax attention of each query block over its own key set.

    q_blocks (B, H, G, Q, D), k/v_blocks (B, H, G, K, D), ``allowed`` a bool mask broadcastable to
    (B, H, G, Q, K). A query with no allowed key outputs zeros. The blocks are folded into a 4-D
    (B·H, G, Q, D) call: 5-D inputs send CPU SDPA to its slow math path, 4-D ones to the flash kernel (3x).
    """
    if q_blocks.dim() != 5:  # already 4-D (e.g. blocks folded by the caller)
        return rows_attention(q_blocks, k_blocks, v_blocks, allowed, call)
    b, h, g, nq, d = q_blocks.shape
    nk = k_blocks.shape[-2]
    if allowed is not None:
        allowed = allowed.reshape((1,) * (5 - allowed.dim()) + tuple(allowed.shape))
        if allowed.shape[0] == 1 and allowed.shape[1] == 1:
            allowed = allowed[0, 0].expand(g, nq, nk)[None]  # shared by every batch row and head: no copy
        else:
            allowed = allowed.expand(b, h, g, nq, nk).reshape(b * h, g, nq, nk)
    out = F.scaled_dot_product_attention(
        q_blocks.reshape(b * h, g, nq, d),
        k_blocks.reshape(b * h, g, nk, d),
        v_blocks.reshape(b * h, g, nk, v_blocks.shape[-1]),
        attn_mask=allowed,
        dropout_p=call.effective_dropout,
        scale=call.scaling,
    )
    return out.view(b, h, g, nq, -1)


def rows_attention(
    q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, call: AttentionCall
) -> torch.Tensor:
    """Selected query rows (B, H, R, D) attending over all keys (global tokens): O(R · n). Under attention
    dropout on CPU, chunk by chunk (:func:`zoo.ops.dropout.dropout_attention`): no (R, n) probabilities kept."""
    if call.training and call.dropout > 0 and flash_available(q_rows):
        return dropout_attention(q_rows, k, v, allowed, call.scaling, Dropout.of(call))
    return F.scaled_dot_product_attention(
        q_rows,
        k,
        v,
        attn_mask=allowed,
        dropout_p=call.effective_dropout,
        scale=call.scaling,
    )
