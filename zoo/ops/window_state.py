"""Sliding-window softmax in parts, and the token shift that feeds a recurrent state the keys leaving the window: the
kernels of the ``window_state`` variant (a window and a state in one layer, LoLCATs / Liger).

:func:`window_softmax_parts` returns, per query i, the unnormalized softmax numerator and denominator over the keys
j with i − W < j ≤ i (plus sinks older than the window) and the maximum m_i they were shifted by:

    N_i = Σ_j e^{s_ij − m_i} v_j,    D_i = Σ_j e^{s_ij − m_i},    m_i = max_j s_ij,    s_ij = scaling · q_i·k_j

so a caller can add another attention's terms before dividing (LoLCATs' shared normalizer) or divide at once. Queries
go in blocks of ``C``: a block reads the ``W + C − 1`` keys it can reach (one (C, W + C − 1) score tile), never n × n.

:func:`shifted` delays a per-token tensor by ``W`` tokens along its token axis, zeros first: a recurrent kernel run on
the delayed keys, values and gates with the undelayed queries gives query i the state after the keys j ≤ i − W, the
keys the window has dropped. Zeros write nothing into any of the zoo's states (k = 0, β = 0, log α = 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.ops.dense import expand_kv
from zoo.ops.state import state_dtype

MIN_QUERY_BLOCK = 64  # queries per score tile, at least (a block of C reads W + C − 1 keys)


def shifted(x: torch.Tensor, count: int) -> torch.Tensor:
    """``x`` (B, H, n, ...) delayed by ``count`` tokens along dim 2: zeros in front, its last ``count`` dropped."""
    if count == 0:
        return x
    pad = [0, 0] * (x.dim() - 3) + [count, 0]
    return F.pad(x, pad)[:, :, : x.shape[2]]


def window_softmax_parts(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    window: int,
    scaling: float,
    end: int,
    real: torch.Tensor | None = None,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, D, m) of the softmax over each query's window, in fp32 (fp64 for fp64 inputs).

    q (B, H, Q, d) at positions ``end − Q .. end − 1``; keys/values (B, Hk, L, d) at ``end − L .. end − 1`` (L ≥ Q);
    ``real`` (B, L) bool over those keys (None: all real); ``sinks`` = (keys (B, Hk, S, d), values, positions (B, S),
    −1 where a row has none), read by a query only once they are older than its window (never twice). Returns N
    (B, H, Q, d_v), D and m (B, H, Q, 1); a query that reads no key (a padding row) gets N = D = 0, m = 0.
    """
    batch, heads, q_len, _ = q.shape
    length = keys.shape[-2]
    first = end - length
    dtype = state_dtype(q)
    block = block or max(MIN_QUERY_BLOCK, window)
    device = q.device
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for start in range(0, q_len, block):
        stop = min(start + block, q_len)
        query_pos = torch.arange(end - q_len + start, end - q_len + stop, device=device)
        lo = max(first, int(query_pos[0]) - window + 1)
        hi = int(query_pos[-1]) + 1
        offset = query_pos[:, None] - torch.arange(lo, hi, device=device)[None, :]  # (C, K): query − key position
        allowed = ((offset >= 0) & (offset < window))[None, None]
        if real is not None:
            allowed = allowed & real[:, None, None, lo - first : hi - first]
        block_keys, block_values = keys[:, :, lo - first : hi - first], values[:, :, lo - first : hi - first]
        if sinks is not None and sinks[0].shape[-2]:
            sink_keys, sink_values, sink_pos = sinks
            older = (sink_pos[:, None, :] >= 0) & (sink_pos[:, None, :] <= query_pos[None, :, None] - window)
            allowed = torch.cat([older[:, None].expand(-1, 1, -1, -1), allowed.expand(batch, -1, -1, -1)], dim=-1)
            block_keys = torch.cat([sink_keys, block_keys], dim=-2)
            block_values = torch.cat([sink_values, block_values], dim=-2)
        block_keys, block_values = expand_kv(block_keys, block_values, heads)
        scores = torch.einsum("bhqd,bhkd->bhqk", q[:, :, start:stop].to(dtype), block_keys.to(dtype)) * scaling
        scores = scores.masked_fill(~allowed, float("-inf"))
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weights = torch.exp(scores - top)
        parts.append((weights @ block_values.to(dtype), weights.sum(dim=-1, keepdim=True), top))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(group, dim=-2) for group in zip(*parts, strict=True))
