"""``sparse_transformer``: the factorized patterns of Child et al. 2019, with stride l (``stride``) and c summary
columns (``num_summary``); ``layout`` picks ``'strided'`` or ``'fixed'`` (``pattern`` is its old name, still accepted).

One attention uses the **union** of the paper's two heads' key sets, in one softmax per query (causality and padding
on top): ``strided`` = local ``|i − j| < l`` ∪ every l-th column ``(i − j) mod l == 0``; ``fixed`` = same block
``⌊i/l⌋ == ⌊j/l⌋`` ∪ summary columns ``j mod l ≥ l − c``. Each is two disjoint key parts merged by
:func:`zoo.ops.union_attention`, never n x n. Decoding: ``fixed`` keeps its summary columns and the last l − 1 keys
(:class:`zoo.cache.WindowedLayer`); ``strided`` keeps every key (:class:`zoo.cache.GrowingLayer`).

Kernels, costs and history: docs/notes/variants.md#sparse_transformer
"""

from __future__ import annotations

import math

import torch

from zoo.cache import GrowingLayer, WindowedLayer
from zoo.ops import (
    GatheredPart,
    KeyPart,
    allowed_mask,
    band_part,
    blocked_attention,
    by_row_span,
    pad_to_multiple,
    selected_attention,
    split_blocks,
    union_attention,
)
from zoo.pattern import Pattern, band, or_masks, residue_columns, same_block, summary_columns
from zoo.variant import AttentionCall, Param, Variant, VariantParameterError


class SparseTransformerAttention(Variant):
    name = "sparse_transformer"
    exact = True
    time_complexity = "O(n·(l + n/l)) = O(n·√n) at l ≈ √n"
    memory_complexity = "O(n·(l + n/l))"
    params = {
        "layout": Param("strided", str, "'strided' (local ∪ every l-th) or 'fixed' (block ∪ summaries)",
                        choices=("strided", "fixed")),
        "stride": Param(128, int, "l: local width and column period", min=2),
        "num_summary": Param(8, int, "c: summary columns at the end of each block ('fixed' only)", min=1),
    }
    test_params = {"stride": 8, "num_summary": 2}
    renamed_params = {"pattern": "layout"}  # until 0.1.0 (it lost to the pattern() method)

    def check_config(self) -> None:
        if self.layout == "fixed" and self.num_summary > self.stride:
            raise VariantParameterError(
                f"attention-zoo variant 'sparse_transformer': parameter 'num_summary' = {self.num_summary} must be "
                f"<= 'stride' = {self.stride} (a block of l tokens has at most l summary columns)."
            )

    # ---------------------------------------------------------------------------------------------------
    # the spec

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int) -> Pattern:
        """``strided``: band (reach l − 1) ∪ residue columns; ``fixed``: same block ∪ summary columns (the sinks of
        windowed decoding, whose reach l − 1 covers the query's block)."""
        stride, summary = self.stride, self.num_summary
        if self.layout == "strided":
            return Pattern(or_masks(band(stride - 1), residue_columns(stride)))
        sinks = summary_columns(stride, summary, call.row_start)  # blocks counted from each row's first real token
        return Pattern(or_masks(same_block(stride, call.row_start), sinks), reach=stride - 1,
                       sinks=lambda b, idx: sinks(b, None, None, idx))

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        """Scores the kernel computes (masked ones included) times 4·d (QK^T and PV)."""
        stride = self.stride
        if n <= stride:
            return 4.0 * n * n * heads * head_dim
        rows = math.ceil(n / stride)
        if self.layout == "strided":
            block = _local_block(stride)
            keys_per_query = _band_reach(stride, block) * (1 if causal else 2) + block + rows
        else:
            keys_per_query = stride + rows * self.num_summary
        return 4.0 * rows * stride * keys_per_query * heads * head_dim

    # ---------------------------------------------------------------------------------------------------
    # the kernel

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if call.decoding:  # the new tokens over the keys of a cache
            return self.attend_new_tokens(q, k, v, call)
        if self.layout == "fixed":  # its blocks count from each row's first real token
            return by_row_span(self._attend_span, q, k, v, call)
        return self._attend_span(q, k, v, call)

    def _attend_span(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        n = k.shape[-2]
        if n <= self.stride:  # the pattern covers every pair: plain attention is the exact answer
            return _full_attention(q, k, v, call)
        key_real = _key_real(call.padding_mask, n, self.stride, q.device)
        q, k, v = (pad_to_multiple(x, self.stride) for x in (q, k, v))
        if self.layout == "strided":
            parts = _strided_parts(q, k, v, key_real, call.causal, self.stride)
        else:
            parts = _fixed_parts(q, k, v, key_real, call.causal, self.stride, self.num_summary)
        return union_attention(parts, call)[:, :, :n]

    def attend_new_tokens(self, q, k, v, call: AttentionCall) -> torch.Tensor:
        """Decoding (causal; the queries are the newest tokens): each query over the keys of its pattern only,
        gathered (:func:`zoo.ops.selected_attention`). ``fixed``: its block and the summary columns, O(l + n·c/l)
        per token; ``strided``: the l previous tokens and every l-th one, O(l + n/l) per token. Keys come from the
        windowed cache (``fixed``) or a cache of every key (positions 0 .. n-1)."""
        if not call.causal:
            raise ValueError(
                f"attention-zoo variant 'sparse_transformer': query length {q.shape[-2]} != key length "
                f"{k.shape[-2]} is only supported for causal decoding steps."
            )
        layer = call.cache if isinstance(call.cache, WindowedLayer) else None
        query_positions = call.query_positions(q.shape[-2], k.shape[-2], q.device)
        stride, summary = self.stride, self.num_summary
        fixed = self.layout == "fixed"

        def select(rows: slice) -> torch.Tensor:
            first, last = int(query_positions[rows.start]), int(query_positions[rows.stop - 1])
            if layer is not None:  # the summary columns are its sinks, its window reaches the block start
                return layer.select(first, last)
            low = max(0, first - stride + 1)  # covers the query's block wherever its row starts
            if fixed:  # the summary columns of the earlier blocks of any row (the pattern keeps each row's own)
                earlier = torch.arange(low, device=q.device)
                starts = call.row_start if call.row_start is not None else torch.zeros(1, dtype=torch.long)
                rank = (earlier[None, :] - starts.to(q.device)[:, None]) % stride
                columns = [earlier[(rank >= stride - summary).any(0)]]
            else:  # every l-th column of each residue among the queries, below the local band
                columns = [torch.arange(r, max(r, low), stride, device=q.device)
                           for r in sorted(set((query_positions[rows] % stride).tolist()))]
            return torch.cat([*columns, torch.arange(low, last + 1, device=q.device)])

        return selected_attention(q, k, v, call, select, self.pattern(call, q.shape[-2], k.shape[-2]),
                                  chunk=stride if fixed else 8)

    def cache_layer(self, layer_idx: int, config):
        """``fixed``: the pattern's windowed cache (summary columns as sinks, the last l - 1 keys); ``strided`` keeps
        every key (its every-l-th columns reach back to the first token), appended in O(1)."""
        return GrowingLayer() if self.layout == "strided" else super().cache_layer(layer_idx, config)


# -------------------------------------------------------------------------------------------------------
# helpers


def _local_block(stride: int) -> int:
    """Query block of the strided kernel's local band: half the stride (less masked waste than a full stride,
    still matmuls of useful size); the stride itself when odd or small."""
    return stride // 2 if stride % 2 == 0 and stride >= 32 else stride


def _band_reach(stride: int, block: int) -> int:
    """Keys before (and after) a query block that cover ``|i − j| < stride``: stride − 1 rounded up to blocks."""
    return math.ceil((stride - 1) / block) * block


def _key_real(padding_mask: torch.Tensor | None, n: int, stride: int, device) -> torch.Tensor:
    """(batch|1, n padded to a stride multiple) bool: True for real keys (padding and the internal tail False)."""
    real = padding_mask if padding_mask is not None else torch.ones(1, n, dtype=torch.bool, device=device)
    return pad_to_multiple(real, stride, dim=-1, value=False)


def _full_attention(q, k, v, call: AttentionCall) -> torch.Tensor:
    n = q.shape[-2]  # n <= stride: the mask is small
    return blocked_attention(q, k, v, allowed_mask(call, None, q.shape[0], 1, n, n, q.device), call)


def _strided_parts(q, k, v, key_real, causal: bool, stride: int) -> list[KeyPart]:
    """Local band (query blocks of ``_local_block``) and same-residue columns (j ≡ i mod l, j != i)."""
    n = q.shape[-2]
    local = band_part(q, k, v, key_real, stride, causal, _local_block(stride))
    row = torch.arange(n // stride, device=q.device)
    other_row = (row[None, :] < row[:, None]) if causal else (row[None, :] != row[:, None])
    column_real = _to_residue_rows(key_real[:, None, :, None], stride)[..., 0]  # (B|1, 1, l, rows)
    columns = KeyPart(
        _to_residue_rows(q, stride), _to_residue_rows(k, stride), _to_residue_rows(v, stride),
        other_row[None, None, None] & column_real[:, :, :, None, :], transposed=True,
    )
    return [local, columns]


def _fixed_parts(q, k, v, key_real, causal: bool, stride: int, summary: int) -> list:
    """Own block (a view) and the summary columns of the other blocks (earlier ones when causal).

    The summary columns are the last ``summary`` tokens of every block: copied out once (n·c/l rows per head)
    as key blocks of c tokens that every query block gathers, chunk by chunk (a :class:`GatheredPart`), so no
    per-query-block copy of all summaries, nor its gradient, ever exists whole.
    """
    batch, heads, n, dim = q.shape
    blocks = n // stride
    within = torch.ones(stride, stride, dtype=torch.bool, device=q.device)
    if causal:
        within = within.tril()
    own = KeyPart(
        split_blocks(q, stride), split_blocks(k, stride), split_blocks(v, stride),
        within & split_blocks(key_real[:, None, :, None], stride).transpose(-1, -2),  # (B|1, 1, G, l, l)
    )
    tails = [split_blocks(x, stride)[:, :, :, stride - summary :].reshape(-1, summary, x.shape[-1]) for x in (k, v)]
    tail_real = key_real.view(key_real.shape[0], blocks, stride)[:, :, stride - summary :]  # (B|1, G, c)
    column_block = torch.arange(blocks, device=q.device)[None, :]

    def allowed(start: int, stop: int) -> torch.Tensor:
        entries = torch.arange(start, stop, device=q.device)
        own_block = (entries % blocks)[:, None]
        other = (column_block < own_block) if causal else (column_block != own_block)  # (e, G)
        rows = entries // (blocks * heads) if tail_real.shape[0] > 1 else torch.zeros_like(entries)
        return (other[:, :, None] & tail_real[rows]).view(stop - start, 1, blocks * summary)

    entries = torch.arange(batch * heads * blocks, device=q.device)
    index = (entries // blocks * blocks)[:, None] + column_block  # every block of the entry's (batch, head)
    queries = q.reshape(batch * heads * blocks, stride, dim)
    return [own, GatheredPart(queries, *tails, index, allowed, (batch, heads))]


def _to_residue_rows(x: torch.Tensor, stride: int) -> torch.Tensor:
    """(B, H, n, D) -> (B, H, l, n/l, D): token r + a·l at [r, a] (a view)."""
    return x.view(x.shape[0], x.shape[1], -1, stride, x.shape[-1]).transpose(2, 3)
