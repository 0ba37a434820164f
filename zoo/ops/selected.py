"""Attention of a few new queries over the keys their pattern selects (decoding with a cache).

A decoding step has one query (a few in assisted decoding) and a cache of keys; a sparse pattern lets it see a
small subset. :func:`selected_attention` gathers that subset per chunk of queries and runs one small softmax
attention over it, so the work per token is the pattern's (window + sinks, stride + columns, ...), not the
length of the context, and nothing of size queries x context is built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zoo.ops.blocked import rows_attention
from zoo.variant import AttentionCall

# (rows of the queries, key indices (K',) or (H, K'), query positions (C, 1), key positions (1|H, 1, K')) -> mask
PatternMask = Callable[[slice, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: AttentionCall,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    select: Callable[[slice], slice | torch.Tensor | None],
    allowed: PatternMask | None = None,
    chunk: int = 64,
) -> torch.Tensor:
    """Causal softmax attention of queries q (B, H, Q, D) at ``query_positions`` (Q,) over the keys k/v
    (B, H, K, D) at ``key_positions`` (K,), restricted per chunk of ``chunk`` queries to the keys ``select(rows)``
    names: a slice (views, no copy; None = all keys) or indices, (K',) shared by the heads or (H, K') per head.
    ``allowed(rows, index, query positions (C, 1), key positions (1|H, 1, K'))`` refines the
    pattern inside the selection (bool, broadcastable to (B|1, H|1, C, K')); causality and ``call.padding_mask``
    (B|1, K) are applied on top. Returns (B, H, Q, Dv); a query with no allowed key outputs zeros.
    """
    batch, heads, count, _ = q.shape
    outs = []
    for start in range(0, count, chunk):
        rows = slice(start, min(start + chunk, count))
        index = select(rows)
        if index is None:
            index = slice(None)
        keys, values = _gather(k, index), _gather(v, index)
        q_pos = query_positions[rows][:, None]
        k_pos = key_positions[index][..., None, :]  # (1, K') or (H, 1, K')
        per_head = isinstance(index, torch.Tensor) and index.dim() == 2
        mask = k_pos <= q_pos
        if allowed is not None:
            mask = mask & allowed(rows, index, q_pos, k_pos)
        if call.padding_mask is not None:
            real = call.padding_mask[:, index]  # (B, K') or (B, H, K')
            mask = mask & (real[:, :, None, :] if per_head else real[:, None, None, :])
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        outs.append(rows_attention(q[:, :, rows], keys, values, mask, call))
    return torch.cat(outs, dim=2)


def _gather(x: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    """x (B, H, K, D) at ``index`` (a slice or (K',)) -> (B, H, K', D), or per head (H, K') -> (B, H, K', D)."""
    if isinstance(index, slice):
        return x[:, :, index]
    if index.dim() == 1:
        return x.index_select(2, index)
    heads = torch.arange(x.shape[1], device=x.device)[:, None]
    return x[:, heads, index]  # advanced indexing: ~3x faster than gather with an expanded index on CPU
