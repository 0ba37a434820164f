"""Blocked building blocks for sparse variants (Longformer, BigBird, Sparse Transformer).

Queries are cut into blocks; each query block attends to a small set of keys (a band around it, or
gathered key blocks) through one batched ``scaled_dot_product_attention`` call with a broadcast mask.
Cost O(n · keys_per_block · d); nothing of size n x n is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.variant import AttentionCall


def split_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, N, D) with N a multiple of ``block`` -> (B, H, N // block, block, D) (a view)."""
    b, h, n, d = x.shape
    return x.view(b, h, n // block, block, d)


def band_blocks(x: torch.Tensor, block: int, before: int, after: int) -> torch.Tensor:
    """Keys of a band around each query block: (B, H, N, D) -> (B, H, N // block, before + block + after, D).

    Block ``g`` gets positions ``[g*block - before, (g+1)*block + after)``; positions outside [0, N)
    are zeros and must be masked by the caller (see :func:`band_positions`). ``before`` and ``after``
    must be multiples of ``block``; the result is a strided view (no copy).
    """
    padded = F.pad(x, (0, 0, before, after))
    return padded.unfold(2, before + block + after, block).transpose(-1, -2)


def band_positions(num_blocks: int, block: int, before: int, after: int, device=None) -> torch.Tensor:
    """Absolute key positions (num_blocks, before + block + after) matching :func:`band_blocks`."""
    starts = torch.arange(num_blocks, device=device) * block - before
    return starts[:, None] + torch.arange(before + block + after, device=device)[None, :]


def gather_blocks(x: torch.Tensor, block: int, block_index: torch.Tensor) -> torch.Tensor:
    """Gather whole key blocks per query block.

    x: (B, H, N, D) with N a multiple of ``block`` (any strides); block_index: (H or 1, G, R) long indices of
    key blocks for each of G query blocks. Returns a contiguous (B, H, G, R * block, D). Uses
    ``index_select`` of whole blocks (backward: ``index_add_`` of whole blocks), about 2x faster on CPU than
    an element-wise ``torch.gather``.
    """
    b, h, n, d = x.shape
    num_blocks = n // block
    _, g, r = block_index.shape
    flat = x.reshape(b, h * num_blocks, block, d)
    head_offsets = torch.arange(h, device=block_index.device)[:, None, None] * num_blocks
    index = (block_index.expand(h, g, r) + head_offsets).reshape(-1)
    return flat.index_select(1, index).view(b, h, g, r * block, d)


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
        dropout_p=call.dropout if call.training else 0.0,
        scale=call.scaling,
    )
    return out.view(b, h, g, nq, -1)


def rows_attention(
    q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, call: AttentionCall
) -> torch.Tensor:
    """Selected query rows (B, H, R, D) attending over all keys (global tokens): O(R · n)."""
    return F.scaled_dot_product_attention(
        q_rows,
        k,
        v,
        attn_mask=allowed,
        dropout_p=call.dropout if call.training else 0.0,
        scale=call.scaling,
    )
