"""StreamingLLM attention (Xiao et al. 2023) over grouped keys: each query sees the first ``sinks`` real tokens of
its row and the last ``recent`` tokens up to itself, nothing else. It is the streaming heads' attention of the ``duo``
variant, in a forward without a cache and over its cache alike.

The keys arrive as one contiguous run of the latest tokens (``keys`` at positions ``end - L .. end - 1``, the queries
being the last ``Q`` of them) plus the sinks (``sink_keys`` at ``sink_pos``, (B, S), −1 where a row has none). Queries
go in blocks: a block of ``C`` queries reads the ``recent + C − 1`` window keys it can reach and the sinks, one SDPA
call with a (B, 1, C, S + recent + C − 1) mask, so nothing of size n × n is built. A sink that is still inside a
query's window is read as a window key only (never twice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.ops.dense import expand_kv

QUERY_BLOCK = 256  # queries per SDPA call (the keys a block reads: sinks + recent + block - 1)


def sink_positions(row_start: torch.Tensor | None, batch: int, sinks: int, device: torch.device) -> torch.Tensor:
    """(B, sinks) long: the positions of each row's first ``sinks`` tokens, from where its real tokens start."""
    start = row_start.to(device) if row_start is not None else torch.zeros(batch, dtype=torch.long, device=device)
    return start[:, None] + torch.arange(sinks, device=device)


def gather_sinks(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, first: int):
    """The rows of ``keys``/``values`` (B, Hk, L, d) at ``positions`` (B, S), the run starting at position ``first``:
    (keys (B, Hk, S, d), values, found (B, S) bool: the position lies inside the run)."""
    index = positions - first
    found = (index >= 0) & (index < keys.shape[-2])
    rows = index.clamp(0, keys.shape[-2] - 1)[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
    return keys.gather(2, rows), values.gather(2, rows), found


def streaming_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    sink_pos: torch.Tensor,
    recent: int,
    scaling: float,
    end: int,
    real: torch.Tensor | None = None,
    block: int = QUERY_BLOCK,
) -> torch.Tensor:
    """q (B, H, Q, d) at positions ``end − Q .. end − 1``; keys/values (B, Hk, L, d) at ``end − L .. end − 1``
    (L ≥ Q); sinks (B, Hk, S, d) at ``sink_pos`` (B, S) (−1: none); ``real`` (B, L) bool over the run (None: all
    real). Returns (B, H, Q, d) in q's dtype. A padding query (not real) reads only itself, so its row is finite (the
    plug zeroes it)."""
    batch, heads, q_len, _ = q.shape
    length = keys.shape[-2]
    first = end - length
    device = q.device
    query_real = real[:, -q_len:] if real is not None else None
    outs = []
    for start in range(0, q_len, block):
        stop = min(start + block, q_len)
        query_pos = torch.arange(end - q_len + start, end - q_len + stop, device=device)  # (C,)
        lo = max(first, int(query_pos[0]) - recent + 1)
        hi = int(query_pos[-1]) + 1
        window_pos = torch.arange(lo, hi, device=device)  # (W,)
        offset = query_pos[:, None] - window_pos[None, :]  # (C, W): query minus key position
        in_window = (offset >= 0) & (offset < recent)
        allowed_window = in_window[None].expand(batch, -1, -1)
        if real is not None:
            key_real = real[:, lo - first : hi - first]
            allowed_window = allowed_window & key_real[:, None, :]
            alone = (offset == 0)[None] & ~query_real[:, start:stop, None]  # a padding query reads itself
            allowed_window = allowed_window | alone
        # sinks the window does not cover: older than the query's window, not after the query
        allowed_sinks = (sink_pos[:, None, :] >= 0) & (sink_pos[:, None, :] <= query_pos[None, :, None] - recent)
        mask = torch.cat([allowed_sinks, allowed_window], dim=-1)[:, None]  # (B, 1, C, S + W)
        block_keys = torch.cat([sink_keys, keys[:, :, lo - first : hi - first]], dim=-2)
        block_values = torch.cat([sink_values, values[:, :, lo - first : hi - first]], dim=-2)
        block_keys, block_values = expand_kv(block_keys, block_values, heads)
        outs.append(F.scaled_dot_product_attention(q[:, :, start:stop], block_keys, block_values, attn_mask=mask,
                                                   scale=scaling))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
