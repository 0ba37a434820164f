"""Exact attention of any block-hinted :class:`zoo.pattern.Pattern` on the shared chunked kernels.

A variant that declares only a pattern with ``block_size`` and ``key_blocks`` (no ``attend``) runs here: each query
block gathers the key blocks its hint names (:func:`zoo.ops.gathered_attention`: chunk by chunk on CPU, attention
dropout included), and the mask of a chunk of entries is the pattern's own predicate -- with causality and padding
-- evaluated at that chunk's query and key positions only (O(chunk), never n x n). Decoding steps attend over the
keys the windowed cache kept (or every key) through :func:`zoo.ops.selected_attention`, with the same predicate.
"""

from __future__ import annotations

import torch

from zoo.call import AttentionCall
from zoo.ops.decode_selected import selected_attention
from zoo.ops.dense import pad_to_multiple
from zoo.ops.gathered import gathered_attention
from zoo.pattern import Pattern, with_causality_and_padding


def pattern_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall,
                      pattern: Pattern) -> torch.Tensor:
    """(B, H, q_len, D): softmax attention restricted to ``pattern`` (and causality, padding)."""
    if call.decoding:
        return selected_attention(q, k, v, call, _kept_keys(call, q.shape[-2], k.shape[-2]), pattern)
    batch, heads, n, dim = q.shape
    block = pattern.block_size
    groups = -(-n // block)
    key_blocks = pattern.key_blocks(torch.arange(groups, device=q.device))  # (G, R), may leave the range
    slot_ok = _distinct_in_range(key_blocks, groups)
    key_blocks = key_blocks.clamp(0, groups - 1)
    real = call.padding_mask if call.padding_mask is not None else torch.ones(1, n, dtype=torch.bool, device=q.device)
    rule = with_causality_and_padding(pattern.mask_mod, call.causal, pad_to_multiple(real, block, dim=-1, value=False))
    within = torch.arange(block, device=q.device)

    def allowed(start: int, stop: int) -> torch.Tensor:
        """The chunk's mask; its key positions are made here, per chunk (all of them would be (G, R·block))."""
        entries = torch.arange(start, stop, device=q.device)
        group, row = entries % groups, entries // groups
        b = (row // heads if real.shape[0] > 1 else torch.zeros_like(row))[:, None, None]
        q_pos = (group[:, None] * block + within)[:, :, None]  # (e, Q, 1)
        k_pos = (key_blocks[group][..., None] * block + within).flatten(1)[:, None, :]  # (e, 1, K)
        slot_ok_here = slot_ok[group].repeat_interleave(block, -1)[:, None, :]
        return rule(b, (row % heads)[:, None, None], q_pos, k_pos) & slot_ok_here

    padded = [pad_to_multiple(x, block) for x in (q, k, v)]
    index = key_blocks[None] + (torch.arange(batch * heads, device=q.device) * groups)[:, None, None]
    out = gathered_attention(padded[0].reshape(-1, block, dim), padded[1].reshape(-1, block, dim),
                             padded[2].reshape(-1, block, v.shape[-1]), index.flatten(0, 1), allowed, call)
    return out.view(batch, heads, groups * block, -1)[:, :, :n]


def pattern_flops(pattern: Pattern, n: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs (QK^T and PV) :func:`pattern_attention` computes at length n: every query block scores every key
    block its hint names (masked entries included, as the chunked kernel computes them)."""
    block = pattern.block_size
    groups = -(-n // block)
    slots = pattern.key_blocks(torch.arange(groups)).shape[-1]
    return 4.0 * heads * head_dim * groups * block * slots * block


def _distinct_in_range(key_blocks: torch.Tensor, groups: int) -> torch.Tensor:
    """(G, R) bool: the slot names a block inside the sequence that no earlier slot of its row names.

    Sorted per row (stable, so the earliest slot of a block comes first) and compared with its neighbour: O(G·R log R)
    time and O(G·R) memory, whatever the number of slots (a slots x slots comparison would grow as R² per row)."""
    inside = (key_blocks >= 0) & (key_blocks < groups)
    named = torch.where(inside, key_blocks, -1)
    order = named.argsort(dim=-1, stable=True)
    ranked = named.gather(-1, order)
    repeat = torch.zeros_like(inside)
    repeat[:, 1:] = ranked[:, 1:] == ranked[:, :-1]
    repeated = torch.zeros_like(inside).scatter_(-1, order, repeat)
    return inside & ~repeated


def _kept_keys(call: AttentionCall, q_len: int, kv_len: int):
    """What a decoding chunk of queries reads: the windowed cache's selection, else every key."""
    select = getattr(call.cache, "select", None)
    if select is None:
        return lambda rows: None
    positions = call.query_positions(q_len, kv_len)
    return lambda rows: select(int(positions[rows.start]), int(positions[rows.stop - 1]))
