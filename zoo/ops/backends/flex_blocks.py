"""FlexAttention over keys chosen from the content: MoBA's and NSA's selected blocks, NSA's compressed keys.

A pattern variant's block mask is known before the call and cached (:mod:`zoo.ops.backends.flex`); here the keys are
known only once the kernel has scored them, so each call builds its ``BlockMask`` from the selection itself
(``BlockMask.from_kv_blocks``, through :func:`zoo.ops.backends.flex.to_block_mask`), in O(n · n / block) work and
memory (the order of the gate scores the selection already computed), never an n x n tensor:

* chosen blocks (:func:`chosen_blocks_attention`): each query's key blocks as a table (B, S, n, nb) bool (S: one
  selection per query head, or one per KV head shared by its group). A Flex tile (128 queries x 128 keys) is listed
  for its query tile when any of its queries chose a block overlapping its keys, full when every pair is chosen and
  causal; the kernel's mask function looks a pair's block up in the table (one flat index: the CPU template compiles
  no 2-D indexing). Flex computes the union of the choices of 128 neighbouring queries: cheap where neighbours choose
  alike, as MoBA's and NSA's gates tend to.
* keys visible from a position on (:func:`visible_keys_attention`): key j is seen by the queries at positions
  >= ``ends[j]`` (NSA's compressed blocks, each seen once it is complete), queries and keys of different lengths.

Flex runs the forward and, on CUDA, the backward (torch 2.13 has no CPU backward: :mod:`zoo.ops.backends.choice`
refuses a CPU call that needs a gradient). The table is a fresh tensor each call: compiled Flex takes it as an input
and does not recompile for new values (CPU: once per length bucket, as for patterns).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from zoo.call import AttentionCall
from zoo.ops.backends import flex
from zoo.ops.backends.flex import FLEX_BLOCK
from zoo.pattern import MaskMod


def chosen_blocks_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                            chosen: torch.Tensor, block: int, call: AttentionCall, compiled: bool = True):
    """Causal attention of each query over the key blocks it chose, one softmax, on FlexAttention.

    Args:
        q: (B, H, n, D) queries at positions 0 .. n - 1 of one row span.
        k, v: (B, H_kv, n, D) with H a multiple of H_kv (GQA without expanding).
        blocks, chosen: (B, S, n, R) the blocks of ``block`` keys (from position 0) each query reads where
            ``chosen``, S = H (a selection per query head) or a divisor of it (shared by H / S heads); a block at or
            after the query's own is read causally.
        call: the call (scale, key padding inside the span).
        compiled: False runs Flex's eager reference (it ignores the block lists): tests only.

    Returns:
        (B, H, n, Dv).
    """
    n = q.shape[-2]
    length = flex.bucket_length(n, q.device)
    mask = chosen_blocks_mask(blocks, chosen, block, q.shape[1], call.padding_mask, n, length)
    return flex.run(mask, q, k, v, call.scaling, compiled, length, length)


def chosen_blocks_mask(blocks: torch.Tensor, chosen: torch.Tensor, block: int, heads: int,
                       padding_mask: torch.Tensor | None, n: int, length: int | None = None) -> BlockMask:
    """The causal BlockMask of :func:`chosen_blocks_attention`'s selection for ``heads`` query heads, over inputs
    padded to ``length`` tokens (default n)."""
    batch, selectors = blocks.shape[:2]
    nb = -(-n // block)
    table = torch.zeros(batch, selectors, n, nb + 1, dtype=torch.bool, device=blocks.device)
    table = table.scatter_(-1, torch.where(chosen, blocks, nb), True)[..., :nb].contiguous()  # slot nb: not chosen
    tiles = math.ceil(n / FLEX_BLOCK)
    per_tile = F.pad(table, (0, 0, 0, tiles * FLEX_BLOCK - n)).unflatten(2, (tiles, FLEX_BLOCK))
    per_tile = per_tile.sum(3, dtype=torch.float32)  # (B, S, nt, nb): the tile's queries choosing each block
    counts = (per_tile @ flex.tile_overlap(n, block, nb, blocks.device).T).round().to(torch.int32)
    groups = heads // selectors
    if groups > 1:
        counts = counts.repeat_interleave(groups, 1)
    return flex.to_block_mask(_chosen_lookup(table, block, groups), counts, True, padding_mask, n, length or n)


def _chosen_lookup(table: torch.Tensor, block: int, groups: int) -> MaskMod:
    """Whether query q_idx of head h chose the block of kv_idx: one lookup in the flattened (B, S, n, nb) table."""
    _, selectors, n, nb = table.shape
    flat = table.flatten()

    def chosen_block(b, h, q_idx, kv_idx):
        return flat[((b * selectors + h // groups) * n + q_idx) * nb + kv_idx // block]

    return chosen_block


def visible_keys_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ends: torch.Tensor,
                           filled: torch.Tensor, call: AttentionCall, compiled: bool = True) -> torch.Tensor:
    """Attention of each query over the keys visible to it, on FlexAttention; a query that sees none outputs zeros.

    Args:
        q: (B, H, n, D) queries at positions 0 .. n - 1.
        keys, values: (B, H_kv, J, D), J >= 1, H a multiple of H_kv.
        ends: (J,) long, nondecreasing: key j is visible to the queries at positions >= ends[j].
        filled: (B|1, J) bool: key j holds a real token (else it is never visible).
        call: the call (scale).
        compiled: False runs Flex's eager reference (tests only).

    Returns:
        (B, H, n, Dv).
    """
    n, count = q.shape[-2], keys.shape[-2]
    length, kv_length = flex.bucket_length(n, q.device), flex.bucket_length(count, q.device)
    mask = visible_keys_mask(ends, filled.expand(q.shape[0], count), n, length, kv_length)
    return flex.run(mask, q, keys, values, call.scaling, compiled, length, kv_length)


def visible_keys_mask(ends: torch.Tensor, filled: torch.Tensor, n: int, length: int | None = None,
                      kv_length: int | None = None) -> BlockMask:
    """The BlockMask of :func:`visible_keys_attention` (``filled`` (B, J)) for n queries and J keys padded to
    ``length`` and ``kv_length``: each query tile lists the key tiles up to its last query's visible keys."""
    count = ends.shape[-1]
    seen = torch.searchsorted(ends, torch.arange(n, device=ends.device), right=True)  # (n,) keys visible to each
    tiles, key_tiles = math.ceil(n / FLEX_BLOCK), math.ceil(count / FLEX_BLOCK)
    per_key_tile = (seen[:, None] - torch.arange(key_tiles, device=ends.device) * FLEX_BLOCK).clamp(0, FLEX_BLOCK)
    counts = F.pad(per_key_tile, (0, 0, 0, tiles * FLEX_BLOCK - n)).unflatten(0, (tiles, FLEX_BLOCK)).sum(1)
    padding = None if bool(filled.all()) else filled

    def visible(b, h, q_idx, kv_idx):
        return ends[kv_idx] <= q_idx

    return flex.to_block_mask(visible, counts[None, None].to(torch.int32), False, padding, n, length or n,
                              keys=(count, kv_length or count))
