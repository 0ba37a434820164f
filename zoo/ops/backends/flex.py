"""FlexAttention for exact patterns: a ``BlockMask`` built from a :class:`~zoo.pattern.Pattern` (composed with
causality and padding), cached, and one call of compiled ``torch.nn.attention.flex_attention``. Which calls run here
is the plug's policy (:mod:`zoo.plug.backend`); this module only runs them.

The block mask is never built from an n x n tensor, nor from n² predicate evaluations where the pattern has hints:
the predicate is evaluated only on the candidate tiles its hints name (``key_blocks``, or ``reach`` with ``sinks``
and ``global_queries``: O(n · keys per query)), in chunks of at most :data:`zoo.ops.limits.FLEX_EVAL_CHUNK_ELEMENTS`
(query, key) pairs. A
pattern of whole blocks (``Pattern.whole_blocks``: BigBird's layout) is evaluated once per block pair and looked up
per block inside the kernel (so it need not be traceable); any other pattern's predicate runs inside the kernel on
the partial tiles (it must be traceable by torch.compile: index arithmetic and indexing of captured tensors).
Masks are cached per (pattern identity, causality, padding, shape, device): layers with the same pattern share one.
Compilation: dynamic shapes on CUDA (no recompilation for a new length); on CPU static, per length bucket
(:func:`bucket_length`: 2^k or 1.5 * 2^k tokens, the padding hidden by the mask), so ``generate`` on prompts of
varying length compiles a few times, not once per prompt (on CPU a pattern that captures a tensor of n entries,
as ``longformer`` with a per-row ``global_attention_mask`` does, still compiles once per length: the kernel
specializes on its shape; fixed global offsets capture only one start per row). Compiled Flex never runs eagerly:
a call that would recompile past ``torch._dynamo.config.recompile_limit`` (where dynamo would silently run
``flex_attention`` eagerly, B·H·n² scores) raises :class:`FlexRecompileLimitError` instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers.masking_utils import and_masks, causal_mask_function

from zoo.call import AttentionCall
from zoo.ops import limits
from zoo.pattern import MaskMod, Pattern, TokenSet

FLEX_BLOCK = 128  # FlexAttention's tile (its default)
MASK_CACHE_SIZE = 32
FINGERPRINT_ELEMENTS = 1 << 20  # captured tensors up to this size count by value, larger ones by identity
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_masks: OrderedDict[tuple, BlockMask] = OrderedDict()


# ---------------------------------------------------------------------------------------------------------------
# the call


def attend(pattern: Pattern, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall,
           compiled: bool = True) -> torch.Tensor:
    """(B, H, n, D) queries over (B, H_kv, n, D) keys/values (H a multiple of H_kv: GQA without expanding) ->
    (B, H, n, D), softmax attention restricted to ``pattern``, causality and padding. ``compiled=False`` runs
    FlexAttention's eager reference (O(n²) memory: it ignores the block mask), for tests only."""
    n = q.shape[-2]
    length = bucket_length(n, q.device)
    block_mask = block_mask_for(pattern, call, q.shape[0], q.shape[1], n, q.device, length)
    return run(block_mask, q, k, v, call.scaling, compiled, length, length)


def run(block_mask: BlockMask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        compiled: bool = True, length: int | None = None, kv_length: int | None = None) -> torch.Tensor:
    """One FlexAttention call of ``block_mask`` (built for q padded to ``length`` tokens and k/v to ``kv_length``;
    default: as given), the padded query rows cut off; compiled, never eager past dynamo's recompile limit."""
    n = q.shape[-2]
    q = _padded(q, length)
    k, v = _padded(k, kv_length), _padded(v, kv_length)
    kernel = _compiled_flex(q.device.type == "cuda") if compiled else flex_attention
    arguments = dict(block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if not compiled:
        out = kernel(q, k, v, **arguments)
    else:  # past dynamo's recompile limit flex_attention would run eager (B·H·n² scores): raise instead
        try:
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                out = kernel(q, k, v, **arguments)
        except FailOnRecompileLimitHit as exc:
            raise FlexRecompileLimitError(
                f"compiled flex_attention reached torch._dynamo.config.recompile_limit "
                f"({torch._dynamo.config.recompile_limit}) compilations (one per distinct pattern and length "
                "bucket): past it FlexAttention would run eagerly and build every n x n score"
            ) from exc
    return out[:, :, :n] if out.shape[-2] > n else out


def _padded(x: torch.Tensor, length: int | None) -> torch.Tensor:
    """(..., n, D) padded with zeros to ``length`` tokens (the block mask hides them)."""
    if length is None or length <= x.shape[-2]:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, length - x.shape[-2]))


class FlexRecompileLimitError(RuntimeError):
    """Compiled ``flex_attention`` would recompile past dynamo's limit and run eagerly (O(n²) memory): the call did
    not run. The plug's policy (:mod:`zoo.plug.backend`) takes the variant's chunked kernel or raises."""


def bucket_length(n: int, device: torch.device) -> int:
    """The length Flex runs at. CUDA: n (compiled with dynamic shapes). CPU: n rounded up to 2^k or 1.5 * 2^k (at
    least one tile), so prompts of varying length share a few static compilations -- torch 2.13's CPU template
    fails to compile patterns with ``//`` or ``%`` under dynamic shapes (a C++ error naming ``cur_qSplitSize0``)."""
    if device.type == "cuda":
        return n
    if n <= FLEX_BLOCK:
        return FLEX_BLOCK
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if power * 3 // 4 >= n else power


@functools.cache
def _compiled_flex(dynamic: bool) -> Callable:
    """One compiled FlexAttention per shape policy (CUDA: dynamic, one compilation for every length; CPU: static,
    one per length bucket of :func:`bucket_length`)."""
    return torch.compile(flex_attention, dynamic=dynamic)


# ---------------------------------------------------------------------------------------------------------------
# the block mask


def block_mask_for(
    pattern: Pattern, call: AttentionCall, batch: int, heads: int, n: int, device, length: int | None = None
) -> BlockMask:
    """The cached BlockMask of ``pattern`` for this call (built once per pattern identity and shape), for inputs
    padded to ``length`` (default n) tokens."""
    length = length or n
    key = (_fingerprint(pattern), call.causal, _fingerprint(call.padding_mask), batch, heads, n, length,
           torch.device(device))
    mask = _masks.get(key)
    if mask is None:
        mask = build_block_mask(pattern, call.causal, call.padding_mask, batch, heads, n, device, length)
        _masks[key] = mask
        if len(_masks) > MASK_CACHE_SIZE:
            _masks.popitem(last=False)
    else:
        _masks.move_to_end(key)
    return mask


def build_block_mask(
    pattern: Pattern, causal: bool, padding_mask: torch.Tensor | None, batch: int, heads: int, n: int, device,
    length: int | None = None,
) -> BlockMask:
    """BlockMask (tiles of :data:`FLEX_BLOCK`) of ``pattern`` ∧ causality ∧ padding (keys) over n tokens, for inputs
    padded to ``length`` tokens (the keys after n hidden).

    A pattern of whole blocks (``whole_blocks``: BigBird's layout) is evaluated once per (block, block) pair and
    looked up per block inside the kernel (so its predicate need not be traceable); any other pattern is evaluated
    pair by pair on the candidate tiles its hints name (:func:`candidate_tiles`) and runs inside the kernel."""
    length = length or n
    if pattern.whole_blocks and pattern.block_size:
        table = block_table(pattern, batch, heads, n, device)
        counts = _tile_counts_of_blocks(table, pattern.block_size, n, pattern.block_origin)
        blocks = math.ceil(length / pattern.block_size)
        kernel_pattern = _block_lookup(_pad_tiles(table, blocks), pattern.block_size, pattern.block_origin, blocks)
    else:
        counts = pattern_tile_counts(pattern, batch, heads, n, device)
        kernel_pattern = pattern.mask_mod
    return to_block_mask(kernel_pattern, counts, causal, padding_mask, n, length)


def block_table(pattern: Pattern, batch: int, heads: int, n: int, device) -> torch.Tensor:
    """(B|1, H|1, nb, nb) bool: a whole-blocks pattern evaluated at the first pair of each (block, block) tile, the
    blocks of each row counted from its ``block_origin``."""
    starts = torch.arange(0, n, pattern.block_size, device=device)
    if pattern.block_origin is None:
        allowed = _evaluate(pattern, batch, heads, starts[:, None], starts[None, :], device)
        return allowed.expand(*allowed.shape[:2], len(starts), len(starts))
    origin = pattern.block_origin.to(device)
    rows = (origin[:, None] + starts).clamp(max=n - 1)  # (B, nb) each row's block starts
    b = torch.arange(len(origin), device=device)[:, None, None, None]
    h = torch.arange(heads, device=device)[None, :, None, None]
    allowed = torch.as_tensor(pattern(b, h, rows[:, None, :, None], rows[:, None, None, :]), device=device)
    return allowed.expand(len(origin), allowed.shape[1], len(starts), len(starts))


def _tile_counts_of_blocks(blocks: torch.Tensor, block: int, n: int,
                           origin: torch.Tensor | None = None) -> torch.Tensor:
    """(..., nb, nb) per-block weights (allowed: 1) -> (..., nt, nt) int32 pairs per FLEX_BLOCK tile, any block
    size: overlap (nt, nb) @ blocks @ overlap^T, overlap[t, i] = tokens (below n) in both tile t and block i (the
    blocks of row b from ``origin[b]`` on; tokens before it belong to no block: their pairs count as not allowed)."""
    position = torch.arange(n, device=blocks.device)
    if origin is None:
        overlap = tile_overlap(n, block, blocks.shape[-1], blocks.device)
        return (overlap @ blocks.float() @ overlap.T).round().to(torch.int32)
    origin = origin.to(blocks.device)
    rank = position[None, :] - origin[:, None]  # (B, n)
    inside = (rank >= 0).float()
    block_of = (rank.clamp(min=0) // block).clamp(max=blocks.shape[-1] - 1)
    overlap = torch.zeros(len(origin), math.ceil(n / FLEX_BLOCK), blocks.shape[-1], device=blocks.device)
    rows = torch.arange(len(origin), device=blocks.device)[:, None].expand_as(rank)
    overlap.index_put_((rows, (position // FLEX_BLOCK).expand_as(rank), block_of), inside, accumulate=True)
    overlap = overlap[:, None]  # (B, 1, nt, nb)
    return (overlap @ blocks.float() @ overlap.transpose(-1, -2)).round().to(torch.int32)


def tile_overlap(n: int, block: int, blocks: int, device) -> torch.Tensor:
    """(nt, blocks) fp32: tokens below n in both FLEX_BLOCK tile t and block i of ``block`` tokens from 0."""
    position = torch.arange(n, device=device)
    overlap = torch.zeros(math.ceil(n / FLEX_BLOCK), blocks, device=device)
    overlap.index_put_((position // FLEX_BLOCK, position // block), torch.ones(n, device=device), accumulate=True)
    return overlap


def candidate_tiles(pattern: Pattern, batch: int, n: int, device) -> torch.Tensor:
    """(nt, nt) bool: the FLEX_BLOCK tiles the pattern may touch, from its hints (all tiles without hints).

    ``key_blocks`` (with ``block_size``): the named key blocks of each query block, mapped onto tiles. ``reach``:
    the tiles within reach, the columns of tiles holding ``sinks`` and the rows of tiles holding ``global_queries``.
    """
    tiles = math.ceil(n / FLEX_BLOCK)
    if pattern.key_blocks is not None and pattern.block_size:
        num_blocks = math.ceil(n / pattern.block_size)
        named = pattern.key_blocks(torch.arange(num_blocks, device=device)).to(device)
        inside = (named >= 0) & (named < num_blocks)
        per_block = torch.zeros(num_blocks, num_blocks, device=device)
        per_block.scatter_(1, named.clamp(0, num_blocks - 1), inside.float(), reduce="add")
        return _tile_counts_of_blocks(per_block, pattern.block_size, n) > 0
    if pattern.reach is None:
        return torch.ones(tiles, tiles, dtype=torch.bool, device=device)
    tile = torch.arange(tiles, device=device)
    candidates = (tile[:, None] - tile[None, :]).abs() <= math.ceil(pattern.reach / FLEX_BLOCK)
    rows, positions = torch.arange(batch, device=device)[:, None], torch.arange(n, device=device)[None, :]
    if pattern.sinks:
        candidates |= _tiles_holding(pattern.sinks(rows, positions), n)[None, :]
    if pattern.global_queries:
        candidates |= _tiles_holding(pattern.global_queries(rows, positions), n)[:, None]
    return candidates


def _tiles_holding(members: torch.Tensor, n: int) -> torch.Tensor:
    """(B|1, n) bool token members -> (nt,) bool: tiles holding a member in any row."""
    members = torch.as_tensor(members).reshape(-1, n).any(0)
    return torch.nn.functional.pad(members, (0, -n % FLEX_BLOCK)).unflatten(0, (-1, FLEX_BLOCK)).any(-1)


def pattern_tile_counts(pattern: Pattern, batch: int, heads: int, n: int, device) -> torch.Tensor:
    """(B|1, H|1, nt, nt) int32 allowed pairs per FLEX_BLOCK tile (B or H is 1 when the pattern does not depend on
    it), evaluated on the candidate tiles only: O(n · candidate keys per query), never an n x n tensor. Query tiles
    go in chunks of at most :data:`zoo.ops.limits.FLEX_EVAL_CHUNK_ELEMENTS` pairs, sorted by their number of
    candidate tiles and grouped with rows at most twice as wide (a global row of tiles does not widen the chunks of band
    rows)."""
    candidates = candidate_tiles(pattern, batch, n, device)
    tiles = candidates.shape[0]
    probe = _evaluate(pattern, batch, heads, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                      device)
    counts = torch.zeros(*probe.shape[:2], tiles, tiles, dtype=torch.int32, device=device)
    widths = candidates.sum(-1)
    order = widths.argsort(stable=True)
    cost = FLEX_BLOCK * FLEX_BLOCK * probe.shape[0] * probe.shape[1]
    start = 0
    while start < tiles:
        narrowest = max(1, int(widths[order[start]]))
        similar = int(torch.searchsorted(widths[order], 2 * narrowest, right=True)) - start  # padding at most 2x
        size = min(similar, max(1, limits.FLEX_EVAL_CHUNK_ELEMENTS // (narrowest * cost)))
        while size > 1 and int(widths[order[start + size - 1]]) * size * cost > limits.FLEX_EVAL_CHUNK_ELEMENTS:
            size //= 2
        query_tiles = order[start : start + size]
        width = int(widths[query_tiles].max())
        key_tiles = candidates[query_tiles].to(torch.int8).argsort(dim=-1, descending=True, stable=True)[:, :width]
        named = torch.gather(candidates[query_tiles], 1, key_tiles)  # (s, width): False for filler slots
        counts[:, :, query_tiles[:, None], key_tiles] = _count_tiles(pattern, batch, heads, n, query_tiles, key_tiles,
                                                                     device) * named
        start += size
    return counts


def _count_tiles(pattern: Pattern, batch: int, heads: int, n: int, query_tiles: torch.Tensor,
                 key_tiles: torch.Tensor, device) -> torch.Tensor:
    """(B|1, H|1, s, width) int32 allowed pairs (positions below n) of query tile i with key tile key_tiles[i, j]."""
    within = torch.arange(FLEX_BLOCK, device=device)
    query = (query_tiles[:, None] * FLEX_BLOCK + within).reshape(-1, 1)  # (s·T, 1)
    key = (key_tiles[:, :, None] * FLEX_BLOCK + within).flatten(1)  # (s, width·T)
    key = key.repeat_interleave(FLEX_BLOCK, 0)  # (s·T, width·T): each query row with its tile's keys
    allowed = _evaluate(pattern, batch, heads, query, key, device) & (query < n) & (key < n)
    tiles = allowed.unflatten(-1, (-1, FLEX_BLOCK)).unflatten(-3, (-1, FLEX_BLOCK))  # (B, H, s, T, width, T)
    return tiles.sum(dim=(-3, -1), dtype=torch.int32)


def _evaluate(pattern: Pattern, batch: int, heads: int, query: torch.Tensor, key: torch.Tensor, device) -> torch.Tensor:
    """The pattern on (rows, cols) query and key positions for every batch row and head: (B|1, H|1, rows, cols)."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(heads, device=device)[None, :, None, None]
    allowed = torch.as_tensor(pattern(b, h, query.to(device)[None, None], key.to(device)[None, None]), device=device)
    while allowed.dim() < 4:
        allowed = allowed[None]
    return allowed.expand(*allowed.shape[:2], *torch.broadcast_shapes(query.shape, key.shape))


def _block_lookup(covered: torch.Tensor, block: int, origin: torch.Tensor | None = None,
                  blocks: int | None = None) -> MaskMod:
    """The predicate of a pattern that covers whole blocks: one lookup in its (B|1, H|1, nb, nb) block table
    (flattened: the CPU kernel template of torch 2.13 does not compile 2-D indexing of a captured tensor), the blocks
    of row b counted from ``origin[b]`` (a position before it is padding: any block answers)."""
    batches, heads, rows, cols = covered.shape
    table = covered.flatten()
    last = torch.tensor((blocks or rows) - 1, device=covered.device)
    origin = None if origin is None else origin.to(covered.device)

    def block_pattern(b, h, q_idx, kv_idx):
        if origin is None:
            index = (q_idx // block) * cols + kv_idx // block
        else:
            start = origin[b]
            query = torch.minimum(torch.clamp(q_idx - start, min=0) // block, last)
            key = torch.minimum(torch.clamp(kv_idx - start, min=0) // block, last)
            index = query * cols + key
        if heads > 1:
            index = index + h * (rows * cols)
        if batches > 1:
            index = index + b * (heads * rows * cols)
        return table[index]

    return block_pattern


def _key_padding(padding_mask: torch.Tensor) -> MaskMod:
    """transformers' ``padding_mask_function`` on a flattened (batch, n) mask (see :func:`_block_lookup`)."""
    n = padding_mask.shape[-1]
    real = padding_mask.flatten()
    if padding_mask.shape[0] == 1:  # one row for every batch row (the keys past n of an unpadded batch)
        return lambda b, h, q_idx, kv_idx: real[kv_idx]
    return lambda b, h, q_idx, kv_idx: real[b * n + kv_idx]


def to_block_mask(
    pattern: MaskMod, counts: torch.Tensor, causal: bool, padding_mask: torch.Tensor | None, n: int,
    length: int, block: int = FLEX_BLOCK, keys: tuple[int, int] | None = None,
) -> BlockMask:
    """BlockMask over ``length`` >= n tokens from the pattern's tile counts over the first n, causality and the key
    padding (tile level: a tile is full when every pair is allowed, below the diagonal under causality and every key
    real; empty when no pair is allowed, above the diagonal under causality or no key real; keys from n on are
    padding). ``keys``: (kv_n, kv_length) where the keys are not the queries (``padding_mask`` then covers kv_n)."""
    kv_n, kv_length = keys or (n, length)
    counts = _pad_tiles(counts, math.ceil(length / block), math.ceil(kv_length / block))
    full = counts == block * block
    partial = counts > 0
    parts = [pattern if (length, kv_length) == (n, kv_n) else _within(pattern, n, kv_n, counts.device)]
    if causal:
        tile = torch.arange(counts.shape[-1], device=counts.device)
        full, partial = full & (tile[None, :] < tile[:, None]), partial & (tile[None, :] <= tile[:, None])
        parts.append(causal_mask_function)
    if padding_mask is not None or kv_length > kv_n:
        real = padding_mask if padding_mask is not None else torch.ones(1, kv_n, dtype=torch.bool)
        real = torch.nn.functional.pad(real.to(device=counts.device, dtype=torch.bool), (0, kv_length - kv_n))
        real_per_tile = torch.nn.functional.pad(real, (0, -kv_length % block)).unflatten(-1, (-1, block)).sum(-1)
        real_per_tile = real_per_tile[:, None, None, :]  # (B, 1, 1, tiles)
        full, partial = full & (real_per_tile == block), partial & (real_per_tile > 0)
        parts.append(_key_padding(real))
    partial = partial & ~full
    mask_mod = and_masks(*parts) if len(parts) > 1 else parts[0]
    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(length, kv_length)
    )


def _within(pattern: MaskMod, n: int, kv_n: int, device) -> MaskMod:
    """``pattern`` on inputs padded beyond n queries and kv_n keys: positions clamped into range (its captured
    tensors have n or kv_n entries); the key padding hides the padded keys, and the padded query rows are cut off. The
    bounds are tensors, so the compiled kernel does not specialize on them."""
    last, last_key = torch.tensor(n - 1, device=device), torch.tensor(kv_n - 1, device=device)
    return lambda b, h, q_idx, kv_idx: pattern(b, h, torch.minimum(q_idx, last), torch.minimum(kv_idx, last_key))


def _pad_tiles(tiles: torch.Tensor, rows: int, cols: int | None = None) -> torch.Tensor:
    """(..., nb, nb') tile table padded with zeros / False to (..., rows, cols) (default: rows)."""
    cols = rows if cols is None else cols
    return torch.nn.functional.pad(tiles, (0, cols - tiles.shape[-1], 0, rows - tiles.shape[-2]))


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, nq, nk) bool -> (count per query block row (B, H, nq), key block indices, the set ones first)."""
    counts = tiles.sum(-1, dtype=torch.int32)
    indices = tiles.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.contiguous(), indices.contiguous()


# ---------------------------------------------------------------------------------------------------------------
# pattern identity


def _fingerprint(value: Any, depth: int = 0) -> Any:
    """A hashable identity of a predicate (its code and the values it closes over) or of what it captured: two
    layers whose patterns capture equal values share one BlockMask. Unknown objects count by identity."""
    if depth > 6:
        return id(value)
    if value is None or isinstance(value, (bool, int, float, str, torch.device, torch.dtype)):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() > FINGERPRINT_ELEMENTS:
            return id(value)
        data = value.detach().cpu().contiguous().flatten().view(torch.uint8)
        return (tuple(value.shape), value.dtype, value.device, hash(tuple(data.tolist())))
    if isinstance(value, (list, tuple)):
        return tuple(_fingerprint(x, depth + 1) for x in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _fingerprint(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, types.FunctionType):
        cells = tuple(_fingerprint(c.cell_contents, depth + 1) for c in value.__closure__ or ())
        return (value.__code__, cells)
    if isinstance(value, (Pattern, TokenSet)):
        return (type(value), *(_fingerprint(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)))
    if isinstance(value, AttentionCall):
        return ("call", value.layer_idx, value.causal, _fingerprint(value.padding_mask, depth + 1),
                _fingerprint(value.extra, depth + 1))
    return id(value)
