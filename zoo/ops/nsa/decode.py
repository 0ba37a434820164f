"""NSA's decoding step: new queries over a cache of every key and the compressed blocks the cache keeps."""

from __future__ import annotations

import torch

from zoo.call import AttentionCall
from zoo.ops.chosen_blocks import attention_at_positions, decode_block_attention
from zoo.ops.nsa.kernel import NSABlocks, compressed_branch, compressed_ends, select


def nsa_decode_branches(q, k, v, call: AttentionCall, geometry: NSABlocks, keys, values, filled, starts):
    """The three outputs of new queries (B, H, Q, D) over a cache of every key (k/v (B, H, n, D), query heads),
    given each row's compressed keys/values (B, H_kv, J, D) and ``filled`` (B, J), blocks counted from each row's first
    real token ``starts`` (B,): O(J·d + top_n·l'·d + w·d) per query."""
    heads, count, n = q.shape[1], q.shape[-2], k.shape[-2]
    groups = heads // keys.shape[1]
    positions = call.query_positions(count, n, q.device)
    ends = compressed_ends(keys.shape[-2], geometry, q.device, starts)

    def visible(rows: slice) -> torch.Tensor:
        return ((ends[:, None, :] <= positions[rows, None]) & filled[:, None, :])[:, None]

    own = torch.div(positions[None] - starts[:, None], geometry.select, rounding_mode="floor").clamp(min=0)
    blocks, chosen = select(q, keys, visible, own, geometry, geometry.selection_count(n), call.scaling)
    blocks, chosen, keys, values = (x.repeat_interleave(groups, 1) for x in (blocks, chosen, keys, values))
    key_pos = positions[:, None] - geometry.window + 1 + torch.arange(geometry.window, device=q.device)  # (Q, w)
    in_window = (key_pos >= 0).expand(*q.shape[:2], -1, -1)
    return (
        compressed_branch(q, keys, values, visible, call),
        decode_block_attention(q, k, v, call, geometry.select, blocks, chosen, starts, positions),
        attention_at_positions(q, k, v, key_pos.expand(*q.shape[:2], -1, -1), in_window, call),
    )
