"""Attention patterns: which keys each query may see, said once per variant as one `Pattern`.

A pattern's predicate is a ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (the shape of transformers'
``masking_utils`` mask functions and FlexAttention's ``mask_mod``), composed from the small named predicates below
with `or_masks` / `and_masks`. It says nothing about causality or padding: the plug adds those once
(`with_causality_and_padding`). Beside it, structural hints that kernels, the decoding cache and FLOPs read:
``reach``, ``sinks``, ``global_queries`` (what a windowed cache keeps), ``block_size`` with ``key_blocks`` (the key
blocks each query block reads, for the shared chunked kernel `zoo.ops.patterned`; `band_key_blocks` for a
band; no built-in variant sets it) and ``whole_blocks`` (constant on block tiles counted from each row's
``block_origin``, its first real token: BigBird sets it with ``block_size``) and ``plain_window`` (a band of
``reach`` with its sinks and nothing less: one decoding query over a windowed cache's selection needs no mask).

Hints in detail and where each built-in pattern is defined: docs/notes/internals.md#pattern
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.masking_utils import and_masks, causal_mask_function, or_masks, padding_mask_function

MaskMod = Callable[[Any, Any, Any, Any], Any]
"""``(b, h, q_idx, kv_idx) -> bool``: the predicate of a pattern (FlexAttention's ``mask_mod``)."""

__all__ = [
    "MaskMod",
    "Pattern",
    "PredicateOnly",
    "TokenSet",
    "and_masks",
    "band",
    "band_key_blocks",
    "causal_mask_function",
    "global_columns",
    "global_rows",
    "or_masks",
    "padding_mask_function",
    "residue_columns",
    "row_starts",
    "same_block",
    "summary_columns",
    "with_causality_and_padding",
]


# ------------------------------------------------------------------------------------------------------
# named predicates


def band(reach: int, dilation: int = 1) -> MaskMod:
    """A (dilated) sliding window: ``|q − kv| ≤ reach`` and ``(q − kv) mod dilation == 0``.

    Args:
        reach: how far (in tokens) a query sees on each side; causality is added by the plug, not here.
        dilation: keep every ``dilation``-th key of the window (1: every key).

    Returns:
        The predicate ``(b, h, q_idx, kv_idx) -> bool``.
    """

    def band_mask(b, h, q_idx, kv_idx):
        offset = q_idx - kv_idx
        inside = offset.abs() <= reach
        return inside if dilation == 1 else inside & (offset % dilation == 0)

    return band_mask


def residue_columns(stride: int) -> MaskMod:
    """Every stride-th key counted from the query, ``(q − kv) mod stride == 0`` (Sparse Transformer's columns).

    Args:
        stride: the distance between two columns.

    Returns:
        The predicate ``(b, h, q_idx, kv_idx) -> bool``.
    """

    def residue_mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) % stride == 0

    return residue_mask


def same_block(size: int, row_start: torch.Tensor | None = None) -> MaskMod:
    """The query's own block, ``⌊q / size⌋ == ⌊kv / size⌋``, blocks counted from each row's first real token.

    Args:
        size: the block size in tokens.
        row_start: (batch or 1,) long, each row's first real token (`AttentionCall.row_start`); None: every row
            starts at 0.

    Returns:
        The predicate ``(b, h, q_idx, kv_idx) -> bool``.
    """

    def same_block_mask(b, h, q_idx, kv_idx):
        start = _start(row_start, b)
        return (q_idx - start) // size == (kv_idx - start) // size

    return same_block_mask


def summary_columns(stride: int, count: int, row_start: torch.Tensor | None = None) -> MaskMod:
    """The last ``count`` tokens of every block of ``stride``, seen by every query: ``kv mod stride ≥ stride − count``.

    Args:
        stride: the block size in tokens (Sparse Transformer's ``fixed`` layout).
        count: summary tokens per block.
        row_start: (batch or 1,) long, each row's first real token; None: blocks counted from 0.

    Returns:
        The predicate ``(b, h, q_idx, kv_idx) -> bool``.
    """

    def summary_mask(b, h, q_idx, kv_idx):
        return (kv_idx - _start(row_start, b)) % stride >= stride - count

    return summary_mask


def _start(row_start: torch.Tensor | None, b):
    """Where row ``b`` starts (0 when every row starts at 0)."""
    return 0 if row_start is None else row_start[_row(row_start, b)]


@dataclass(frozen=True)
class TokenSet:
    """Tokens singled out by position (global tokens, sinks); calling it, ``tokens(b, idx) -> bool``, tells membership.

    Attributes:
        offsets: positions counted from each row's first real token.
        marked: (batch or 1, L) bool, positions of the sequence itself (a per-row ``global_attention_mask`` over the
            first L tokens), or None.
        row_start: (batch or 1,) long, each row's first real token; None: every row starts at 0.
    """

    offsets: tuple[int, ...] = ()
    marked: torch.Tensor | None = None
    row_start: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.offsets) or (self.marked is not None and bool(self.marked.any()))

    def last_position(self) -> int:
        """The largest position any row has in the set (-1 when empty)."""
        last = -1
        if self.offsets:
            last = max(self.offsets) + (int(self.row_start.max()) if self.row_start is not None else 0)
        if self.marked is not None and bool(self.marked.any()):
            last = max(last, int(self.marked.any(0).nonzero().max()))
        return last

    def __call__(self, b, idx):
        """Traceable by torch.compile (FlexAttention runs it inside its kernel): comparisons and 1-D lookups in the
        captured tensors only, no tensor made inside (``torch.tensor``/``isin`` fail to compile there)."""
        idx = torch.as_tensor(idx)
        member = idx < 0  # all False, shaped like idx
        if self.offsets:
            rank = idx if self.row_start is None else idx - self.row_start[_row(self.row_start, b)]
            for offset in self.offsets:
                member = member | (rank == offset)
        if self.marked is not None:
            length = self.marked.shape[-1]
            marked = self.marked.to(idx.device).flatten()  # flat: 2-D lookups do not compile on CPU (torch 2.13)
            inside = idx < length
            member = member | (marked[_row(self.marked, b) * length + idx.clamp(max=length - 1)] & inside)
        return member


def _row(per_row: torch.Tensor, b):
    """The row index into ``per_row`` (B|1, ...) for batch index ``b`` (a tensor, or None outside a batch)."""
    return 0 if per_row.shape[0] == 1 or b is None else b


def global_rows(tokens: TokenSet) -> MaskMod:
    """Queries in ``tokens`` see every key.

    Args:
        tokens: the global queries.

    Returns:
        The predicate ``(b, h, q_idx, kv_idx) -> bool``.
    """

    def global_rows_mask(b, h, q_idx, kv_idx):
        return tokens(b, q_idx)

    return global_rows_mask


def global_columns(tokens: TokenSet) -> MaskMod:
    """Keys in ``tokens`` are seen by every query.

    Args:
        tokens: the global keys (Longformer's global tokens, StreamingLLM's sinks).

    Returns:
        The predicate ``(b, h, q_idx, kv_idx) -> bool``.
    """

    def global_columns_mask(b, h, q_idx, kv_idx):
        return tokens(b, kv_idx)

    return global_columns_mask


def row_starts(padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The position of each row's first real token (left padding).

    Inside a compiled graph the starts are returned even when all are 0 (deciding that would read the tensor on the
    host and break the graph); zeros mean the same as None to every consumer.

    Args:
        padding_mask: (batch, n) bool or int, nonzero for real tokens, or None.

    Returns:
        (batch,) long, or None when every row starts at 0.
    """
    if padding_mask is None:
        return None
    starts = padding_mask.to(torch.uint8).argmax(-1)
    if torch.compiler.is_compiling():
        return starts
    return starts if bool(starts.any()) else None


def with_causality_and_padding(mask_mod: MaskMod | None, causal: bool, padding_mask: torch.Tensor | None):
    """A predicate with the plug's causal and padding rules added.

    Args:
        mask_mod: the pattern's predicate, or None (every key).
        causal: add ``kv_idx ≤ q_idx``.
        padding_mask: (batch, kv_len) bool over the key positions, True for real tokens, or None.

    Returns:
        The combined predicate, or None when nothing restricts the call.
    """
    parts = [m for m in (mask_mod, causal_mask_function if causal else None) if m is not None]
    if padding_mask is not None:
        parts.append(padding_mask_function(padding_mask))
    if not parts:
        return None
    return and_masks(*parts) if len(parts) > 1 else parts[0]


# ------------------------------------------------------------------------------------------------------
# the pattern object


@dataclass(frozen=True)
class Pattern:
    """Which keys each query may see (before causality and padding), and the hints derived from the same rule.

    Calling a pattern evaluates its predicate: ``pattern(b, h, q_idx, kv_idx)``. From it come the test reference, the
    decoding cache, the FlexAttention block mask and, with block hints, an exact chunked kernel.

    Attributes:
        mask_mod: the predicate ``(b, h, q_idx, kv_idx) -> bool``.
        reach: the farthest key behind a query the band reaches (a windowed cache keeps the last ``reach`` keys);
            None: unbounded.
        sinks: keys every query sees and a windowed cache keeps forever.
        global_queries: queries that see every key.
        block_size: the tile size of ``key_blocks`` and ``whole_blocks``.
        key_blocks: maps (query blocks,) long to (query blocks, K) long, the key blocks each query block reads (-1:
            none); what the shared chunked kernel and the FLOP count use.
    """

    mask_mod: MaskMod
    reach: int | None = None
    sinks: TokenSet | None = None
    global_queries: TokenSet | None = None
    block_size: int | None = None
    key_blocks: Callable[[torch.Tensor], torch.Tensor] | None = None
    whole_blocks: bool = False
    """The predicate is constant on each ``block_size`` x ``block_size`` tile (BigBird's block layout): one pair
    per tile decides the tile (`zoo.ops.backends.flex` builds its block mask from that)."""
    block_origin: torch.Tensor | None = None
    """(B|1,) long: where each row's whole blocks start (its first real token, so the blocks do not move with the
    amount of padding); None: every row's blocks start at 0."""
    plain_window: bool = False
    """Every key within ``reach`` behind a query and every sink is in the pattern (a sliding window with sinks, no
    holes such as a dilation): what a windowed cache selects for one query past the ``global_queries`` is then
    exactly that query's keys, and a decoding step needs no mask (`zoo.ops.decode_selected.selected_attention`)."""

    def __call__(self, b, h, q_idx, kv_idx):
        return self.mask_mod(b, h, q_idx, kv_idx)

    @property
    def runs_on_flex(self) -> bool:
        """Whether FlexAttention may run it (not a bare predicate of plugin API 1: `PredicateOnly`)."""
        return True


@dataclass(frozen=True)
class PredicateOnly(Pattern):
    """A bare predicate returned by the ``pattern()`` of a plugin written for plugin API 1 (attention-zoo 0.1.0),
    wrapped without hints: the dense reference holds the kernel to it, the decoding cache keeps every key, and
    FlexAttention never runs it (without hints its block mask would be evaluated over all n x n pairs)."""

    @property
    def runs_on_flex(self) -> bool:
        return False


def dense_mask(mask_mod: MaskMod | None, causal: bool, padding_mask, batch: int, heads: int, q_len: int, kv_len: int,
               device=None, positions: torch.Tensor | None = None) -> torch.Tensor | None:
    """The O(n²) mask of ``mask_mod`` with causality and padding (tests and references only).

    Returns:
        (batch, heads, q_len, kv_len) bool, or None when nothing restricts the call.
    """
    device = device if device is not None else (padding_mask.device if padding_mask is not None else "cpu")
    span = kv_len  # positions 0 .. span - 1 (known without reading positions on the host)
    if positions is None:
        positions = torch.arange(kv_len, device=device)
    else:
        span = int(positions.max()) + 1
    padded = None
    if padding_mask is not None:  # padding_mask_function indexes by position: spread it over the positions
        padded = torch.zeros(padding_mask.shape[0], span, dtype=torch.bool, device=device)
        padded[:, positions] = padding_mask.to(device)
    predicate = with_causality_and_padding(mask_mod, causal, padded)
    if predicate is None:
        return None
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(heads, device=device)[None, :, None, None]
    q = positions[kv_len - q_len :][None, None, :, None]
    kv = positions[None, None, None, :]
    mask = predicate(b, h, q, kv)
    return mask.expand(mask.shape[0], mask.shape[1], q_len, kv_len)


def band_key_blocks(reach: int, block: int, sinks: TokenSet | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``key_blocks`` hint for a band: the key blocks within ``reach`` of each query block and, first, the blocks
    holding ``sinks`` (the positions up to its last one).

    Args:
        reach: the band's reach in tokens.
        block: the block size in tokens (the pattern's ``block_size``).
        sinks: the pattern's sinks, or None.

    Returns:
        A function from query blocks (G,) long to key blocks (G, R) long (out-of-range indices allowed: the kernel
        drops them).
    """
    side = -(-reach // block)
    around = torch.arange(-side, side + 1)
    sink_blocks = torch.arange(-(-(sinks.last_position() + 1) // block)) if sinks else torch.zeros(0, dtype=torch.long)

    def key_blocks(query_blocks: torch.Tensor) -> torch.Tensor:
        band_part = query_blocks[:, None] + around.to(query_blocks.device)
        return torch.cat([sink_blocks.to(query_blocks.device).expand(len(query_blocks), -1), band_part], -1)

    return key_blocks


def union(parts: Sequence[MaskMod | None]) -> MaskMod | None:
    """``or_masks`` of the parts that are not None (None when none is)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return or_masks(*parts) if len(parts) > 1 else parts[0]
