"""``bigbird``: BigBird ITC block-sparse attention (Zaheer et al. 2020).

Blocks of ``block_size`` tokens. The first and last ``num_global_blocks`` blocks are global (they see every key,
every query sees them); every other query block sees its ``window_blocks`` neighbours (itself and
``window_blocks // 2`` on each side), the global blocks and ``num_random_blocks`` random blocks it does not already
see, so no key counts twice. The random layout is a pure function of (seed, layer, number of blocks, head): the same
in training, eval, every process and after a reload. Causal mode restricts every part to the past and draws a
block's layout from (seed, layer, head) only, so outputs depend neither on later tokens nor on the length.
Decoding keeps every key (:class:`zoo.cache.GrowingLayer`: random blocks may point at any earlier block).

Measurements and history: docs/notes/variants.md#bigbird
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from zoo.cache import GrowingLayer
from zoo.ops import (
    by_row_span,
    gathered_attention,
    pad_to_multiple,
    row_spans,
    rows_attention,
    selected_attention,
    stream_seed,
)
from zoo.pattern import Pattern
from zoo.variant import AttentionCall, Param, Variant, VariantParameterError

LAYOUT_CACHE_SIZE = 256  # (layer, length) layouts kept; each is H·nb·(w+2g+r) indices


@dataclass
class BlockLayout:
    """Which key blocks each query block attends to, per head.

    ``key_blocks`` (H, nb, K) long: slot -> key block (clamped into range); ``valid`` (H, nb, K) bool: False for
    slots that fall outside the sequence or would repeat a block; ``global_queries`` (nb,) bool: query blocks
    that attend to every key (their rows of ``key_blocks`` are unused).
    """

    key_blocks: torch.Tensor
    valid: torch.Tensor
    global_queries: torch.Tensor

    def to(self, device: torch.device) -> BlockLayout:
        return BlockLayout(self.key_blocks.to(device), self.valid.to(device), self.global_queries.to(device))

    @cached_property
    def block_counts(self) -> torch.Tensor:
        """(H, nb, nb) long: how many valid slots of query block i point at key block j (global rows excluded)."""
        heads, num_blocks, _ = self.key_blocks.shape
        counts = torch.zeros(heads, num_blocks, num_blocks, dtype=torch.long, device=self.key_blocks.device)
        return counts.scatter_add_(2, self.key_blocks, self.valid.long())

    @cached_property
    def adjacency(self) -> torch.Tensor:
        """(H, nb, nb) bool: query block i may see key block j."""
        return (self.block_counts > 0) | self.global_queries[None, :, None]


def layout_uniforms(seed: int, layer_idx: int, num_blocks: int, heads: int, draws: int, causal: bool) -> torch.Tensor:
    """(heads, num_blocks, draws) uniforms in [0, 1), one CPU generator per head.

    Bidirectional: seeded by (seed, layer, num_blocks, head). Causal: by (seed, layer, head) only; the CPU
    generator fills rows in order, so row i is the same for every ``num_blocks`` > i.
    """
    length_key = "causal" if causal else num_blocks
    rows = []
    for head in range(heads):
        generator = torch.Generator().manual_seed(stream_seed("bigbird", seed, layer_idx, length_key, head))
        rows.append(torch.rand(num_blocks, draws, generator=generator))
    return torch.stack(rows)


def sample_distinct(uniforms: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = uniforms.shape[-1]`` distinct integers drawn uniformly from [0, count) per row (Floyd's algorithm).

    ``count`` broadcasts against ``uniforms[..., 0]``. Rows with count < r get all of [0, count) and the rest of
    their slots invalid. Returns (picks clamped to >= 0, valid).
    """
    draws = uniforms.shape[-1]
    picks = torch.full(uniforms.shape, -1, dtype=torch.long)
    for step in range(draws):
        top = count - draws + step  # Floyd: draw from [0, top]; if taken, take top (never taken yet)
        draw = torch.minimum((uniforms[..., step] * (top + 1)).long(), top)
        taken = (picks[..., :step] == draw[..., None]).any(-1)
        picks[..., step] = torch.where(taken, top, draw)
    valid = picks >= 0
    return picks.clamp(min=0), valid


def fixed_blocks(num_blocks: int, half_window: int, num_global: int, causal: bool):
    """Window and global key blocks of every query block, and which query blocks are global.

    Returns (blocks (nb, S) long, valid (nb, S) bool, global_queries (nb,) bool). A global block that lies in the
    window is invalid (counted once, as window). Causal: the block and ``half_window`` blocks before it, and the
    first ``num_global`` blocks; no query block is global (the last blocks lie in the future).
    """
    query = torch.arange(num_blocks)[:, None]
    if causal:
        window = query + torch.arange(-half_window, 1)
        globals_ = torch.arange(num_global)[None, :]
        global_valid = globals_ < query - half_window
        global_queries = torch.zeros(num_blocks, dtype=torch.bool)
    else:
        window = query + torch.arange(-half_window, half_window + 1)
        front, back = torch.arange(num_global), torch.arange(num_blocks - num_global, num_blocks)
        globals_ = torch.cat([front, back])[None, :]
        distinct = torch.cat([front < num_blocks, back >= num_global])  # short inputs: front and back overlap
        global_valid = distinct & (globals_ >= 0) & ((globals_ - query).abs() > half_window)
        global_queries = (query[:, 0] < num_global) | (query[:, 0] >= num_blocks - num_global)
    window_valid = (window >= 0) & (window < num_blocks)
    blocks = torch.cat([window, globals_.expand(num_blocks, -1)], -1)
    return blocks, torch.cat([window_valid, global_valid], -1), global_queries


def random_blocks(num_blocks: int, half_window: int, num_global: int, causal: bool, uniforms: torch.Tensor):
    """(H, nb, r) random key blocks and their validity: distinct, uniform among the blocks outside the window and
    the global blocks (causal: among earlier ones); fewer valid ones where fewer candidates exist."""
    query = torch.arange(num_blocks)
    if causal:  # candidates [g, i - half)
        lo, excluded = query - half_window, torch.zeros_like(query)
        count = (lo - num_global).clamp(min=0)
    else:  # candidates [g, nb - g) minus the window [lo, hi]
        lo = (query - half_window).clamp(min=num_global)
        hi = (query + half_window).clamp(max=num_blocks - num_global - 1)
        excluded = (hi - lo + 1).clamp(min=0)
        count = (num_blocks - 2 * num_global - excluded).clamp(min=0)
    ranks, valid = sample_distinct(uniforms, count)
    blocks = num_global + ranks
    return torch.where(blocks >= lo[:, None], blocks + excluded[:, None], blocks), valid


def make_layout(fixed, random: torch.Tensor, random_valid: torch.Tensor) -> BlockLayout:
    """Put :func:`fixed_blocks` (shared by all heads) and per-head random blocks (H, nb, r) into one layout."""
    blocks, valid, global_queries = fixed
    heads, num_blocks, _ = random.shape
    key_blocks = torch.cat([blocks.expand(heads, -1, -1), random], -1).clamp(0, num_blocks - 1)
    valid = torch.cat([valid.expand(heads, -1, -1), random_valid], -1)
    return BlockLayout(key_blocks.contiguous(), valid.contiguous(), global_queries)


class BigBirdAttention(Variant):
    name = "bigbird"
    exact = True
    supports_causal = True
    supports_bidirectional = True
    supports_dropout = True
    time_complexity = "O(n·b·(w+r+2g))"
    memory_complexity = "O(n·d) on CPU, else O(n·b·(w+r+2g))"
    params = {
        "block_size": Param(64, int, "tokens per block", min=1, max=4096),
        "num_random_blocks": Param(3, int, "random key blocks per query block", min=0, max=64),
        "num_global_blocks": Param(1, int, "global blocks at each end (causal: at the start)", min=0, max=64),
        "window_blocks": Param(3, int, "odd: the block itself and window_blocks // 2 on each side", min=1, max=63),
        "seed": Param(0, int, "seed of the random layout (hashed with layer, number of blocks and head)", min=0),
    }
    test_params = {"block_size": 8, "num_random_blocks": 2}

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self._layouts: OrderedDict[tuple, BlockLayout] = OrderedDict()

    def check_config(self) -> None:
        if self.window_blocks % 2 == 0:
            raise VariantParameterError(
                f"attention-zoo variant 'bigbird': parameter 'window_blocks' = {self.window_blocks} is "
                "invalid; allowed: an odd number (the block itself and as many blocks on each side), e.g. 3."
            )

    # -- layout --------------------------------------------------------------------------------------------

    def layout(self, layer_idx: int, num_blocks: int, heads: int, causal: bool, device: torch.device) -> BlockLayout:
        """The (cached) block layout of one layer at ``num_blocks`` blocks."""
        key = (layer_idx, num_blocks, heads, causal, torch.device(device))
        cached = self._layouts.get(key)
        if cached is not None:
            self._layouts.move_to_end(key)
            return cached
        shape = (num_blocks, self.window_blocks // 2, self.num_global_blocks, causal)
        uniforms = layout_uniforms(self.seed, layer_idx, num_blocks, heads, self.num_random_blocks, causal)
        layout = make_layout(fixed_blocks(*shape), *random_blocks(*shape, uniforms)).to(device)
        self._layouts[key] = layout
        if len(self._layouts) > LAYOUT_CACHE_SIZE:
            self._layouts.popitem(last=False)
        return layout

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int) -> Pattern:
        """The kernel's own cached layouts: in each row, counted from its first real token, query block i sees key
        block j when the layout of the row's own block count names j for i (or i is a global block); constant on
        (block, block) tiles from each row's first real token (``whole_blocks``, ``block_origin``)."""
        block = self.block_size
        spans = row_spans(call.padding_mask, kv_len) or [(0, kv_len)]
        lengths = sorted({end - start for start, end in spans})
        num_blocks = max(1, -(-kv_len // block))
        tables = {}

        def table_for(heads: int, device) -> tuple[torch.Tensor, torch.Tensor]:
            """(R, H, nb, nb) adjacency, one per distinct row length (padded to the call's blocks), and (B,) its row."""
            if heads not in tables:
                per_length = []
                for length in lengths:
                    own = self.layout(call.layer_idx, max(1, -(-length // block)), heads, call.causal, device)
                    pad = num_blocks - own.adjacency.shape[-1]
                    per_length.append(F.pad(own.adjacency, (0, pad, 0, pad)))
                which = torch.tensor([lengths.index(end - start) for start, end in spans], device=device)
                tables[heads] = (torch.stack(per_length), which)
            return tables[heads]

        starts = torch.tensor([start for start, _ in spans])
        origin = starts if bool(starts.any()) else None

        def bigbird_blocks(batch_idx, head_idx, q_idx, kv_idx):
            heads = int(torch.as_tensor(head_idx).max()) + 1
            device = torch.as_tensor(q_idx).device
            table, which = table_for(heads, device)
            row = 0 if batch_idx is None else torch.as_tensor(batch_idx).clamp(max=len(spans) - 1)
            start = 0 if origin is None else origin.to(device)[row]
            query_block = ((q_idx - start) // block).clamp(0, num_blocks - 1)
            key_block = ((kv_idx - start) // block).clamp(0, num_blocks - 1)
            return table[which[row] if len(lengths) > 1 else 0, head_idx, query_block, key_block]

        return Pattern(bigbird_blocks, block_size=block, whole_blocks=True, block_origin=origin)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        block, g, r, half = self.block_size, self.num_global_blocks, self.num_random_blocks, self.window_blocks // 2
        num_blocks = -(-n // block)
        if causal:
            keys = min(half + 1 + g + r, num_blocks) * block - block / 2
            return 4.0 * heads * head_dim * num_blocks * block * keys
        global_rows = min(2 * g, num_blocks) * block
        middle_keys = min(2 * half + 1 + 2 * g + r, num_blocks) * block
        padded = num_blocks * block
        return 4.0 * heads * head_dim * (global_rows * padded + (padded - global_rows) * middle_keys)

    # -- kernel --------------------------------------------------------------------------------------------

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Each row over its own real tokens (:func:`zoo.ops.by_row_span`): its blocks start at its first real token
        and its layout is that of its own block count, whatever padding its batch adds."""
        if call.decoding and q.shape[-2] < self.block_size:  # a few new queries over their key blocks
            return self._attend_new_tokens_by_row(q, k, v, call)
        return by_row_span(self._attend_span, q, k, v, call)

    def _attend_span(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        block, kv_len = self.block_size, k.shape[-2]
        num_blocks = -(-kv_len // block)
        layout = self.layout(call.layer_idx, num_blocks, q.shape[1], call.causal, q.device)
        if call.decoding and q.shape[-2] < block:
            return self._attend_new_tokens(q, k, v, layout, call)
        key_real = self._real_keys(call.padding_mask, kv_len, num_blocks * block, q.device)
        k, v = pad_to_multiple(k, block), pad_to_multiple(v, block)
        if call.causal:
            return self._attend_causal(q, k, v, layout, key_real, call, kv_len)
        return self._attend_bidirectional(q, k, v, layout, key_real, call)

    def _attend_new_tokens_by_row(self, q, k, v, call: AttentionCall) -> torch.Tensor:
        """Decoding steps, rows grouped by where their real tokens start: their blocks count from there (causal
        layouts do not depend on the length, so a row decodes what its full forward gives)."""
        starts = call.row_start.tolist() if call.row_start is not None else [0] * q.shape[0]
        groups: dict[int, list[int]] = {}
        for row, start in enumerate(starts):
            groups.setdefault(int(start), []).append(row)
        outs, order = [], []
        for start, rows in groups.items():
            pick = slice(None) if len(rows) == q.shape[0] else torch.tensor(rows, device=q.device)
            positions = call.key_positions(k.shape[-2], q.device)
            mask = None if call.padding_mask is None else call.padding_mask[pick]
            sub = dataclasses.replace(call, padding_mask=mask, row_start=None, positions=positions - start)
            num_blocks = -(-(k.shape[-2] - start) // self.block_size)
            layout = self.layout(call.layer_idx, num_blocks, q.shape[1], call.causal, q.device)
            outs.append(self._attend_new_tokens(q[pick], k[pick], v[pick], layout, sub, start))
            order.extend(rows)
        if len(outs) == 1:
            return outs[0]
        return torch.cat(outs)[torch.tensor(order, device=q.device).argsort()]

    def cache_layer(self, layer_idx: int, config) -> GrowingLayer:
        """Every key (random blocks may point at any earlier block), appended in O(1) amortized."""
        return GrowingLayer()

    def _attend_new_tokens(self, q, k, v, layout: BlockLayout, call: AttentionCall, start: int = 0) -> torch.Tensor:
        """Decoding steps (fewer new queries than a block): each query over the key blocks its block's layout
        names, per head, gathered (:func:`zoo.ops.selected_attention`): O(block·(window + global + random)) per
        token instead of padding the query to a whole block. Keys: every key so far (a GrowingLayer)."""
        block, kv_len = self.block_size, k.shape[-2]
        query_positions = call.query_positions(q.shape[-2], kv_len, q.device)  # counted from the rows' start
        within = torch.arange(block, device=q.device)

        def select(rows: slice) -> torch.Tensor:
            query_block = int(query_positions[rows.start]) // block
            keys = (layout.key_blocks[:, query_block, :, None] * block + within).flatten(1)  # (H, slots·block)
            return (keys + start).clamp(max=kv_len - 1)

        def valid(rows: slice, index: torch.Tensor) -> torch.Tensor:
            """The layout's valid slots, minus the clamped repeats of the last key."""
            query_block = int(query_positions[rows.start]) // block
            slot_valid = layout.valid[:, query_block].repeat_interleave(block, -1)  # (H, slots·block)
            key_blocks = layout.key_blocks[:, query_block].repeat_interleave(block, -1)
            keys = key_blocks * block + within.repeat(slot_valid.shape[-1] // block)
            return slot_valid & (keys + start < kv_len)

        return selected_attention(q, k, v, call, select, valid=valid, chunk=1)

    @staticmethod
    def _real_keys(padding_mask: torch.Tensor | None, kv_len: int, padded_len: int, device) -> torch.Tensor | None:
        """(B or 1, padded_len) bool: real keys (the internal block padding is never real); None if all are."""
        if padding_mask is None:
            if kv_len == padded_len:
                return None
            padding_mask = torch.ones(1, kv_len, dtype=torch.bool, device=device)
        return F.pad(padding_mask.to(device=device, dtype=torch.bool), (0, padded_len - kv_len), value=False)

    def _attend_bidirectional(self, q, k, v, layout: BlockLayout, key_real, call: AttentionCall) -> torch.Tensor:
        """Every query block runs through the gathered kernel (a view of q, no copy); the rows of the global
        query blocks are then replaced by their attention over all keys (2·g blocks of wasted work)."""
        block, n = self.block_size, q.shape[-2]
        num_blocks = layout.global_queries.shape[0]
        front = min(self.num_global_blocks, num_blocks)
        back = max(num_blocks - self.num_global_blocks, front)
        q = pad_to_multiple(q, block)
        out = self._blocked(q, k, v, layout, range(num_blocks), key_real, call)
        if front or back < num_blocks:
            # split, not slicing: its backward concatenates the pieces' gradients instead of zero-filling copies
            sizes = [front * block, (back - front) * block, (num_blocks - back) * block]
            head, _, tail = q.split(sizes, dim=2)
            everything = None if key_real is None else key_real[:, None, None, :]
            global_out = rows_attention(torch.cat([head, tail], dim=2), k, v, everything, call)
            out = torch.cat([global_out[:, :, : sizes[0]], out.split(sizes, dim=2)[1], global_out[:, :, sizes[0] :]],
                            dim=2)
        return out if out.shape[-2] == n else out[:, :, :n]

    def _attend_causal(self, q, k, v, layout: BlockLayout, key_real, call: AttentionCall, kv_len: int):
        """Queries are the last q_len of the kv_len positions (a KV cache holds the earlier ones): pad them on
        the left to a block boundary so query block i covers the positions of key block i."""
        block, q_len, padded_len = self.block_size, q.shape[-2], k.shape[-2]
        first_block, lead = divmod(kv_len - q_len, block)
        q = F.pad(q, (0, 0, lead, padded_len - kv_len))
        positions = torch.arange(first_block * block, padded_len, device=q.device).view(-1, block)
        rows = range(first_block, padded_len // block)
        out = self._blocked(q, k, v, layout, rows, key_real, call, positions)
        return out[:, :, lead : lead + q_len]

    def _blocked(self, q, k, v, layout: BlockLayout, rows: range, key_real, call: AttentionCall,
                 query_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Query blocks ``rows`` (q holds exactly those rows, (B, H, G*block, D)) over their gathered key blocks,
        through :func:`zoo.ops.gathered_attention` with one entry per (batch row, head, query block)."""
        block = self.block_size
        batch, heads, _, dim = q.shape
        num_blocks = k.shape[-2] // block
        key_blocks = layout.key_blocks[:, rows.start : rows.stop]  # (H, G, K)
        groups, slots = key_blocks.shape[1:]
        key_positions = (key_blocks[..., None] * block + torch.arange(block, device=q.device)).flatten(-2)
        allowed = layout.valid[:, rows.start : rows.stop].repeat_interleave(block, -1)[None]  # (1, H, G, K*block)
        if key_real is not None:
            allowed = allowed & key_real[:, key_positions]
        allowed = allowed[..., None, :]  # (B|1, H, G, 1, K*block)
        if query_positions is not None:  # causal: (G, block) absolute positions of the query rows
            allowed = allowed & (key_positions[:, :, None, :] <= query_positions[None, :, :, None])
        entries = batch * heads * groups
        allowed = allowed.expand(batch, heads, groups, -1, -1).reshape(entries, allowed.shape[-2], slots * block)
        first_block = (torch.arange(batch * heads, device=q.device) * num_blocks).view(batch, heads, 1, 1)
        index = (key_blocks[None] + first_block).view(entries, slots)
        out = gathered_attention(
            q.reshape(entries, block, dim),
            k.reshape(-1, block, dim),
            v.reshape(-1, block, v.shape[-1]),
            index,
            allowed,
            call,
        )
        return out.view(batch, heads, groups * block, -1)
