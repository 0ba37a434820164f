"""Attention over chosen key blocks (MoBA's and NSA's selections, :mod:`zoo.ops.choose`): one gathered entry per query
(:func:`gathered_block_attention`, recomputing backward), its dense mask for references (:func:`selected_blocks_mask`),
and the decoding step over a cache of every key (:func:`decode_block_attention`, :func:`attention_at_positions`)."""

from __future__ import annotations

import torch

from zoo.call import AttentionCall
from zoo.ops import limits
from zoo.ops.blocked import rows_attention
from zoo.ops.dense import pad_to_multiple
from zoo.ops.gathered import gathered_attention, key_rows


def gathered_block_attention(q, k, v, call: AttentionCall, block: int, blocks, chosen, positions) -> torch.Tensor:
    """One :func:`zoo.ops.gathered_attention` entry per query over its chosen key blocks (causal, padding).

    Blocks of ``block`` keys from position 0 of one row span; q (B, H, Q, D) at ``positions`` (Q,); blocks/chosen
    (B, H, Q, R): the blocks each query reads (a block named twice would count twice). Returns (B, H, Q, Dv)."""
    batch, heads, count, dim = q.shape
    n = k.shape[-2]
    slots = blocks.shape[-1]
    nb = -(-n // block)
    real = call.padding_mask if call.padding_mask is not None else torch.ones(1, n, dtype=torch.bool,
                                                                              device=q.device)
    real = pad_to_multiple(real, block, dim=-1, value=False)
    flat_blocks, flat_chosen = blocks.reshape(-1, slots), chosen.reshape(-1, slots)
    within = torch.arange(block, device=q.device)

    def allowed(start: int, stop: int) -> torch.Tensor:
        entries = torch.arange(start, stop, device=q.device)
        row = entries // (heads * count) if real.shape[0] > 1 else torch.zeros_like(entries)
        key_pos = (flat_blocks[start:stop, :, None] * block + within).flatten(1)  # (e, R·block)
        ok = flat_chosen[start:stop].repeat_interleave(block, -1) & real[row[:, None], key_pos]
        return (ok & (key_pos <= positions[entries % count, None]))[:, None, :]

    first_block = (torch.arange(batch * heads, device=q.device) * nb).view(batch, heads, 1, 1)
    index = (blocks + first_block).view(-1, slots)
    out = gathered_attention(q.reshape(-1, 1, dim), pad_to_multiple(k, block).reshape(-1, block, dim),
                             pad_to_multiple(v, block).reshape(-1, block, v.shape[-1]), index, allowed, call)
    return out.view(batch, heads, count, -1)


def selected_blocks_mask(blocks: torch.Tensor, chosen: torch.Tensor, block: int, n: int, positions: torch.Tensor,
                         padding_mask: torch.Tensor | None) -> torch.Tensor:
    """The dense (B, H, Q, n) bool mask of the keys :func:`gathered_block_attention` reads: O(n²), tests only."""
    nb = -(-n // block)
    picked = torch.zeros(*blocks.shape[:-1], nb, dtype=torch.long, device=blocks.device)
    picked = picked.scatter_add_(-1, blocks, chosen.long()) > 0
    allowed = picked.repeat_interleave(block, -1)[..., :n] & (torch.arange(n, device=blocks.device)
                                                              <= positions[:, None])
    if padding_mask is not None:
        allowed = allowed & padding_mask[:, None, None, :]
    return allowed


def decode_block_attention(q, k, v, call: AttentionCall, block: int, blocks, chosen, starts,
                           positions) -> torch.Tensor:
    """New queries (B, H, Q, D) at ``positions`` (Q,) over a cache of every key, each over its chosen blocks
    (blocks/chosen (B, H, Q, R)) of ``block`` keys counted from its row's first real token ``starts`` (B,)."""
    n = k.shape[-2]
    within = torch.arange(block, device=q.device)
    key_pos = ((blocks * block)[..., None] + within).flatten(-2) + starts[:, None, None, None]  # (B, H, Q, R·block)
    ok = chosen.repeat_interleave(block, -1) & (key_pos <= positions[:, None]) & (key_pos < n)
    return attention_at_positions(q, k, v, key_pos, ok, call)


def attention_at_positions(q, k, v, key_pos: torch.Tensor, ok: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """Each query (B, H, Q, D) over the keys at ``key_pos`` (B, H, Q, K) where ``ok`` (and the padding mask) allow,
    one softmax: each chunk of queries gathers its keys (about ``limits.GATHER_CHUNK_ELEMENTS`` per
    chunk). For few queries
    (decoding): no recomputing backward. ``k``/``v`` may hold grouped-query heads (H_kv dividing H): query head i reads
    key/value head i // (H / H_kv), gathered directly instead of from a copy expanded to every query head."""
    batch, heads, count, dim = q.shape
    n = k.shape[-2]
    key_pos = key_pos.clamp(0, n - 1)
    if call.padding_mask is not None:
        rows = torch.arange(batch, device=q.device)[:, None, None, None]
        ok = ok & call.padding_mask[rows, key_pos]
    kv_head = torch.div(torch.arange(heads, device=q.device), heads // k.shape[1], rounding_mode="floor")
    keys_at, values_at = key_rows(k), key_rows(v)
    outs, width = [], key_pos.shape[-1]
    chunk = max(1, limits.GATHER_CHUNK_ELEMENTS // (batch * heads * width * dim))
    for start in range(0, count, chunk):
        rows = slice(start, min(start + chunk, count))
        index = key_pos[:, :, rows].flatten(-2)  # (B, H, C·K)
        keys, values = (_rows_at(at, index, kv_head).view(batch, heads, -1, width, at[0].shape[-1])
                        for at in (keys_at, values_at))  # (B, H, C, K, D)
        out = rows_attention(q[:, :, rows, None, :].flatten(0, 1), keys.flatten(0, 1), values.flatten(0, 1),
                             ok[:, :, rows, None, :].flatten(0, 1), call)
        outs.append(out.view(batch, heads, -1, v.shape[-1]))
    return torch.cat(outs, 2)


def _rows_at(at: tuple[torch.Tensor, torch.Tensor, int], index: torch.Tensor, kv_head: torch.Tensor) -> torch.Tensor:
    """Rows of :func:`zoo.ops.gathered.key_rows` ``at`` for positions ``index`` (B, H, K) of query heads reading
    KV heads ``kv_head`` (H,): (B·H·K, D)."""
    rows, first, step = at
    return rows.index_select(0, (index * step + first[:, kv_head, None]).flatten())
