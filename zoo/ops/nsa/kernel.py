"""Native Sparse Attention (NSA, Yuan et al. 2025, arXiv 2502.11089): each query reads three key sets with a softmax
each, and per-token gates mix the three outputs (written from the paper; no code copied).

Geometry (:class:`NSABlocks`), in the coordinates of one row span (positions from the row's first real token):

* compressed: blocks of l = ``compress`` tokens every d = ``stride`` tokens; block i holds tokens i·d .. i·d + l - 1
  and is compressed by a learned map ``compress_fn`` to one key (and one value). Query t reads the compressed blocks
  that end at or before t (a block containing a future token is never visible).
* selection: blocks of l' = ``select`` tokens. Query t's score of selection block j is the compressed attention's
  probability mass over the stride segments (d tokens) that block j holds: p_slc[j] = Σ_{m < l'/d} Σ_{o < l/d}
  p_cmp[(l'/d)·j + m − o], each compressed block counted once per segment it shares with block j (the paper's
  eq. 9, for d dividing l and l'). Scores are summed over the query heads of a KV group, so a group's heads read the
  same blocks. The first block and the two local ones (the query's own, causal inside, and the one before) are
  always read; the other ``top_n`` − (those) are the highest-scoring blocks at or before the own block, ties to the
  earlier block.
* window: the last ``window`` tokens (t − s < window).

Costs: compressed scores O(n·(n/d)·d_h) chunk by chunk of queries, each chunk over the blocks it sees (never
n x n; each chunk recomputed in the backward), the selection from the same scores, the selected attention
O(n·top_n·l'·d_h), the window O(n·w·d_h). On CPU without padding inside the span (the common case) every branch runs
the flash kernels of :mod:`zoo.ops.block_grouped`, a KV group's query heads in the same calls: the compressed branch
by query chunks (:class:`zoo.ops.block_grouped.ChunkedFlash`), the selected blocks by key block (the queries that
chose a block in one call, :func:`zoo.ops.block_grouped.block_grouped_attention`, shared with MoBA), the window as a
run of keys per query block (:func:`zoo.ops.block_grouped.band_attention`). Otherwise: one gathered entry per query
(:func:`zoo.ops.chosen_blocks.gathered_block_attention`) and the band kernel (:func:`zoo.ops.band_part`). The selection
is a hard choice without gradient; gradients reach q, k, v (and the compression map) through the three softmaxes.
Under ``zoo.attention_backend("flex")`` (or ``"auto"`` once measured to win) all three branches run FlexAttention
(:func:`nsa_flex`), their block masks built from the same choice (:mod:`zoo.ops.backends.flex_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from zoo.call import AttentionCall
from zoo.ops import limits
from zoo.ops.backends import flex
from zoo.ops.backends.choice import compiled, content_flex, on_flex
from zoo.ops.backends.fla import fla_nsa_kernel, fla_nsa_selected
from zoo.ops.backends.flex_blocks import chosen_blocks_attention, visible_keys_attention
from zoo.ops.block_grouped import ChunkedFlash, band_attention, block_grouped_attention, by_key_block_applies
from zoo.ops.choose import select_by_query_chunks, top_blocks
from zoo.ops.chosen_blocks import gathered_block_attention
from zoo.ops.dense import pad_to_multiple, safe_softmax, softmax_attention
from zoo.ops.dropout import Dropout
from zoo.ops.flash import additive_mask, flash_available
from zoo.ops.union import band_part, union_attention
from zoo.pattern import Pattern, band

Compress = Callable[[torch.Tensor], torch.Tensor]  # (..., l, D) -> (..., D)
LOCAL_BLOCKS = 2  # the paper's "2 local blocks": the query's own selection block and the one before it


@dataclass(frozen=True)
class NSABlocks:
    """NSA's geometry: compression blocks of ``compress`` tokens every ``stride``, selection blocks of ``select``
    tokens, ``top_n`` selection blocks per query (the first and the local ones included), a window of ``window``."""

    compress: int
    stride: int
    select: int
    top_n: int
    window: int

    def compressed_count(self, n: int) -> int:
        """Complete compression blocks among n tokens."""
        return 0 if n < self.compress else (n - self.compress) // self.stride + 1

    def selection_count(self, n: int) -> int:
        return -(-n // self.select)


def compress(x: torch.Tensor, real: torch.Tensor | None, compress_fn: Compress, geometry: NSABlocks):
    """Compressed tokens of one row span: x (B, H, n, D) -> (B, H, J, D) and ``filled`` (B|1, J) bool (the block
    holds a real token). Padding tokens inside a block are zeroed before compression (they never leak)."""
    count = geometry.compressed_count(x.shape[-2])
    if real is not None:
        x = x * real[:, None, :, None].to(x.dtype)
    blocks = x.unfold(2, geometry.compress, geometry.stride).transpose(-1, -2)  # (B, H, J, l, D), a view
    if real is None:
        filled = torch.ones(1, count, dtype=torch.bool, device=x.device)
    else:
        filled = real.unfold(-1, geometry.compress, geometry.stride).any(-1)
    return compress_fn(blocks[:, :, :count]), filled


def compressed_ends(count: int, geometry: NSABlocks, device, starts: torch.Tensor | None = None) -> torch.Tensor:
    """(B|1, J): the position of the last token of each compressed block (from each row's start ``starts``)."""
    ends = torch.arange(count, device=device) * geometry.stride + geometry.compress - 1
    return ends[None] if starts is None else ends[None] + starts[:, None]


def block_scores(probs: torch.Tensor, geometry: NSABlocks, count: int) -> torch.Tensor:
    """Selection-block scores (..., count) from compressed-attention probabilities (..., J): each compressed block's
    probability added once per stride segment it shares with the selection block (module docstring)."""
    covering = geometry.compress // geometry.stride  # segments of a compressed block
    per_block = geometry.select // geometry.stride  # segments of a selection block
    blocks = probs.shape[-1]
    segments = probs.new_zeros(*probs.shape[:-1], max(count * per_block, blocks + covering - 1))
    for shift in range(covering):  # segment s is held by compressed blocks s - covering + 1 .. s
        segments[..., shift : shift + blocks] += probs
    return segments[..., : count * per_block].unflatten(-1, (count, per_block)).sum(-1)


def select(
    q: torch.Tensor,
    compressed_keys: torch.Tensor,
    visible,
    own: torch.Tensor,
    geometry: NSABlocks,
    count: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's selection blocks, shared by the query heads of a KV group, chunk by chunk without gradient.

    q (B, H, Q, D); compressed_keys (B, H_kv, J, D); ``visible(rows)`` -> (B|1, 1, C, J) bool; own (B|1, Q) long:
    each query's own selection block; ``count`` selection blocks. Returns (blocks, chosen), each
    (B, H_kv, Q, min(top_n, count))."""
    batch, heads, queries, dim = q.shape
    kv_heads, blocks = compressed_keys.shape[1], compressed_keys.shape[2]
    numbers = torch.arange(count, device=q.device)

    def one(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        allowed = visible(rows)
        width = min(blocks, max(1, visible_width(allowed)))  # the chunk's scores over the blocks it sees
        grouped = q[:, :, rows].float().unflatten(1, (kv_heads, heads // kv_heads))  # (B, H_kv, G, C, D)
        scores = torch.einsum("bkgcd,bkjd->bkgcj", grouped, compressed_keys[:, :, :width].float()) * scale
        probs = safe_softmax(scores.masked_fill(~allowed[:, :, None, :, :width], float("-inf"))).sum(2)
        mine = own[:, None, rows, None]
        reach = min(count, int(mine.max()) + 1)  # blocks at or before the chunk's last own block
        ranked = block_scores(probs, geometry, reach)  # (B, H_kv, C, reach)
        candidates = numbers[:reach]
        forced = (candidates == 0) | ((candidates <= mine) & (candidates > mine - LOCAL_BLOCKS))
        picked, chosen = top_blocks(ranked.masked_fill(forced, float("inf")), candidates <= mine, geometry.top_n)
        missing = min(geometry.top_n, count) - picked.shape[-1]  # slots past the reachable blocks: never chosen
        return F.pad(picked, (0, missing)), F.pad(chosen, (0, missing))

    return select_by_query_chunks(one, queries, batch * heads * (blocks + count), 2)


def visible_width(allowed: torch.Tensor) -> int:
    """Keys up to the last one any query of ``allowed`` (..., C, J) sees."""
    seen = allowed.flatten(0, -2).any(0).nonzero()
    return int(seen[-1]) + 1 if len(seen) else 0


def compressed_branch(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible, call: AttentionCall
) -> torch.Tensor:
    """Softmax attention of q (B, H, Q, D) over compressed keys/values (B, H, J, D), ``visible(rows)`` deciding,
    chunk by chunk of queries (a (chunk, J) mask at a time), each chunk recomputed in the backward; a query with no
    visible block outputs zeros. On CPU the chunks run the flash kernels."""
    batch, heads, queries, _ = q.shape
    if keys.shape[-2] == 0:
        return q.new_zeros(batch, heads, queries, values.shape[-1])
    if flash_available(q):
        step = max(1, min(limits.NSA_COMPRESSED_QUERY_CHUNK, limits.SCORE_CHUNK_ELEMENTS // keys.shape[-2]))
        chunks = [slice(start, min(start + step, queries)) for start in range(0, queries, step)]
        return ChunkedFlash.apply(
            _VisiblePrefix(chunks, visible, q.dtype), call.scaling, Dropout.of(call), q, keys, values
        )
    step = max(1, limits.SCORE_CHUNK_ELEMENTS // (batch * heads * keys.shape[-2]))
    grads = torch.is_grad_enabled() and any(x.requires_grad for x in (q, keys, values))
    outs = []
    for start in range(0, queries, step):
        rows = slice(start, min(start + step, queries))
        args = (q[:, :, rows], keys, values, visible(rows), call.scaling, call.effective_dropout, call.training)
        outs.append(checkpoint(softmax_attention, *args, use_reentrant=False) if grads else softmax_attention(*args))
    return torch.cat(outs, 2)


class _VisiblePrefix:
    """:func:`compressed_branch`'s chunks (a :class:`zoo.ops.block_grouped.ChunkedFlash` plan): query ranges,
    each over the keys up to the last one any of its queries sees."""

    def __init__(self, chunks, visible, dtype) -> None:
        self.ranges, self.visible, self.dtype = chunks, visible, dtype

    def chunks(self):
        return self.ranges

    def pieces(self, rows, keys, values):
        allowed = self.visible(rows)
        width = visible_width(allowed)
        if not width:
            return None
        return (
            (slice(None), slice(None), rows),
            keys[:, :, :width],
            values[:, :, :width],
            additive_mask(allowed[..., :width], self.dtype),
        )

    def fold(self, rows, grad, piece_grad) -> None:
        grad[:, :, : piece_grad.shape[2]] += piece_grad


def window_branch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall, window: int, groups: int = 1
) -> torch.Tensor:
    """Causal sliding window (t - s < window) over one row span with as many queries as keys, k/v with the KV heads
    repeated ``groups`` times. On CPU without padding by block diagonals, a KV group's heads together
    (:func:`zoo.ops.block_grouped.band_attention`); otherwise on the band kernel."""
    n = k.shape[-2]
    if flash_available(q) and call.padding_mask is None:
        block = min(limits.NSA_WINDOW_QUERY_BLOCK, max(16, -(-window // 16) * 16))
        return band_attention(q, k[:, ::groups], v[:, ::groups], window, block, call.scaling, Dropout.of(call))
    block = min(128, max(16, -(-(window // 2) // 16) * 16))  # longformer's query blocks
    real = call.padding_mask if call.padding_mask is not None else q.new_ones(1, n, dtype=torch.bool)
    padded = [pad_to_multiple(x, block) for x in (q, k, v)]
    band = band_part(*padded, pad_to_multiple(real, block, dim=-1, value=False), window, True, block)
    return union_attention([band], call)[..., :n, :]


def span_parts(
    q, k, v, call: AttentionCall, geometry: NSABlocks, compress_k: Compress, compress_v: Compress, groups: int
):
    """What both paths over one row span share: compressed keys/values (query heads), visibility, the selection
    (query heads) and the query positions. k/v (B, H, n, D) with the KV heads repeated ``groups`` times (as the plug
    hands them over): compression and selection run per KV head."""
    n = k.shape[-2]
    keys, filled = compress(k[:, ::groups], call.padding_mask, compress_k, geometry)
    values, _ = compress(v[:, ::groups], call.padding_mask, compress_v, geometry)
    positions = torch.arange(n - q.shape[-2], n, device=q.device)
    visible = Visibility(compressed_ends(keys.shape[-2], geometry, q.device), filled, positions)
    count = geometry.selection_count(n)
    blocks, chosen = select(q, keys, visible, (positions // geometry.select)[None], geometry, count, call.scaling)
    blocks, chosen, keys, values = (x.repeat_interleave(groups, 1) for x in (blocks, chosen, keys, values))
    return keys, values, visible, blocks, chosen, positions


@dataclass(frozen=True)
class Visibility:
    """The compressed blocks each query sees: block j once complete (``ends`` (1, J): its last token) and holding a
    real token (``filled`` (B|1, J)); calling it on a range of the queries (at ``positions`` (Q,)) gives their
    (B|1, 1, C, J) bool mask."""

    ends: torch.Tensor
    filled: torch.Tensor
    positions: torch.Tensor

    def __call__(self, rows: slice) -> torch.Tensor:
        return ((self.ends[:, None, :] <= self.positions[rows, None]) & self.filled[:, None, :])[:, None]


def nsa_branches(
    q, k, v, call: AttentionCall, geometry: NSABlocks, compress_k: Compress, compress_v: Compress, groups: int
):
    """(compressed, selected, window) outputs (B, H, Q, Dv) each over one row span (Q = n); ``groups`` query heads
    per KV head (see :func:`span_parts`). On FlexAttention where the backend setting picks it (:func:`nsa_flex`)."""
    if content_flex("nsa", q, k, v, call) and (
        parts := on_flex("nsa", lambda: nsa_flex(q, k, v, call, geometry, compress_k, compress_v, groups, compiled()))
    ) is not None:
        return parts
    keys, values, visible, blocks, chosen, positions = span_parts(
        q, k, v, call, geometry, compress_k, compress_v, groups
    )
    return (
        compressed_branch(q, keys, values, visible, call),
        selected_branch(q, k, v, call, geometry.select, blocks, chosen, positions, groups),
        window_branch(q, k, v, call, geometry.window, groups),
    )


def nsa_flex(q, k, v, call: AttentionCall, geometry: NSABlocks, compress_k: Compress, compress_v: Compress,
             groups: int, compiled: bool = True):
    """:func:`nsa_branches` on FlexAttention, whatever the backend setting, the KV heads unexpanded: the compressed
    blocks as keys visible from their last token on, the selection as a block mask built from it
    (:mod:`zoo.ops.backends.flex_blocks`), the window as a pattern (its mask cached). As many queries as keys;
    forward and, on CUDA, backward (``compiled=False``: Flex's eager reference, tests only)."""
    keys, values, visible, blocks, chosen, _ = span_parts(q, k, v, call, geometry, compress_k, compress_v, groups)
    k, v = k[:, ::groups], v[:, ::groups]
    if keys.shape[-2]:
        compressed = visible_keys_attention(q, keys[:, ::groups], values[:, ::groups], visible.ends[0],
                                            visible.filled, call, compiled)
    else:
        compressed = q.new_zeros(*q.shape[:-1], v.shape[-1])
    reach = geometry.window - 1
    return (
        compressed,
        chosen_blocks_attention(q, k, v, blocks[:, ::groups], chosen[:, ::groups], geometry.select, call, compiled),
        flex.attend(Pattern(band(reach), reach=reach, plain_window=True), q, k, v, call, compiled),
    )


def selected_branch(q, k, v, call: AttentionCall, size: int, blocks, chosen, positions, groups: int):
    """The selected branch over one row span: blocks/chosen (B, H, Q, R) name each query's blocks (its own among
    them, as the selection forces it), the same for the ``groups`` query heads of a KV head. On CPU without padding
    and with as many queries as keys: by key block, each KV group's heads in one call
    (:func:`zoo.ops.block_grouped.block_grouped_attention`); on CUDA on fla's kernel where it applies
    (:func:`zoo.ops.backends.fla.fla_nsa_kernel`); otherwise one gathered entry per query."""
    if (kernel := fla_nsa_kernel(q, k, v, call, size, groups)) is not None:
        return fla_nsa_selected(
            kernel, q, k[:, ::groups], v[:, ::groups], blocks[:, ::groups], chosen[:, ::groups], size, call.scaling
        )
    if not by_key_block_applies(q, k, call):
        return gathered_block_attention(q, k, v, call, size, blocks, chosen, positions)
    blocks, chosen = blocks[:, ::groups], chosen[:, ::groups]
    earlier = chosen & (blocks < (positions // size)[:, None])
    return block_grouped_attention(
        q, k[:, ::groups], v[:, ::groups], blocks, earlier, size, call.scaling, Dropout.of(call)
    )


def mix(gates: torch.Tensor, branches) -> torch.Tensor:
    """Σ_b g_b · o_b: gates (B, H, Q, 3) in (0, 1), branches three (B, H, Q, Dv)."""
    out = gates[..., 0:1] * branches[0]
    for number in (1, 2):
        out = out + gates[..., number : number + 1] * branches[number]
    return out


def nsa_flops(n: int, heads: int, head_dim: int, geometry: NSABlocks) -> float:
    """Forward FLOPs at length n (causal): compressed attention (its scores computed twice: once more to select),
    the selected blocks (the own block causal) and the window."""
    compressed = sum(n - (i * geometry.stride + geometry.compress - 1) for i in range(geometry.compressed_count(n)))
    size = geometry.select
    selected = sum(
        size * min(geometry.top_n, j + 1) * size - size * (size - 1) / 2 for j in range(geometry.selection_count(n))
    )
    w = geometry.window
    window = n * (n + 1) / 2 if n <= w else w * (w + 1) / 2 + (n - w) * w
    return 2.0 * heads * head_dim * (3 * compressed + 2 * selected + 2 * window)
