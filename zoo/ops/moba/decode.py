"""MoBA's decoding step: new queries over a cache of every key and the block summaries the cache keeps."""

from __future__ import annotations

import torch

from zoo.call import AttentionCall
from zoo.ops.chosen_blocks import decode_block_attention
from zoo.ops.moba.kernel import select_blocks


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: AttentionCall,
    block: int,
    top_k: int,
    means: torch.Tensor,
    filled: torch.Tensor,
) -> torch.Tensor:
    """New queries over a cache of every key: (B, H, Q, Dv). Blocks count from each row's first real token
    (``call.row_start``); ``means`` (B, H, J, D) fp32 and ``filled`` (B, J) bool summarize each row's complete
    blocks (the decoding cache keeps them), so a step costs O(J·d + (k + 1)·block·d), not O(n·d).

    Each chunk of queries gathers its keys ((k + 1)·block per query, about ``limits.GATHER_CHUNK_ELEMENTS`` per
    chunk) and runs
    one softmax over them."""
    batch, heads, count, dim = q.shape
    n = k.shape[-2]
    starts = call.row_start if call.row_start is not None else torch.zeros(batch, dtype=torch.long, device=q.device)
    starts = starts.to(q.device)
    positions = call.query_positions(count, n, q.device)
    own = torch.div(positions[None] - starts[:, None], block, rounding_mode="floor").clamp(min=0)  # (B, Q)
    blocks, chosen = select_blocks(q, means, filled[:, None], own, top_k)
    blocks = torch.cat([blocks, own[:, None, :, None].expand(batch, heads, count, 1)], -1)
    chosen = torch.cat([chosen, torch.ones_like(blocks[..., :1], dtype=torch.bool)], -1)
    return decode_block_attention(q, k, v, call, block, blocks, chosen, starts, positions)
