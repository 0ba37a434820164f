"""``moba``: Mixture of Block Attention (Lu et al. 2025, Kimi), causal only.

Keys in blocks of ``block_size`` tokens, counted from each row's first real token. Query t scores each complete
block j before its own by ``q_t · mean(real keys of block j)`` (its gate; no parameters) and attends to its
``top_k`` best such blocks plus its own block (causal inside it), one softmax over the union. Selection is per query
head (as in the paper: with GQA the heads of a KV group choose separately, each against its group's block means);
ties go to the earlier block; blocks without a real key are never chosen. ``top_k`` at least the number of blocks is
causal dense attention. Bidirectional calls are refused: the gate is defined over the past (an encoder layer would
have no "own block" boundary to read up to), so use another variant there.

Kernel (:mod:`zoo.ops.moba`): each row over its own span (:func:`zoo.ops.by_row_span`), the gate chunk by chunk of
queries (O(n²·d / block) time, never n x n), then attention over the chosen blocks (O(n·(top_k + 1)·block·d)): on
CPU by key block (:func:`zoo.ops.block_grouped.block_grouped_attention`, shared with NSA), otherwise one gathered
entry per query (:func:`zoo.ops.gathered_attention`), recomputed in the backward; that kernel choice is the first
line of :func:`zoo.ops.moba.moba_attention`. The gate is a hard choice and gets no gradient.
:meth:`MoBAAttention.reference` is dense softmax attention restricted to the keys the kernel selects (tests only).

Decoding (:class:`MoBALayer`): every key and the mean key of each complete block of each row; a step scores the
block means and gathers its blocks: O(n·d / block + (top_k + 1)·block·d) per token.
"""

from __future__ import annotations

import torch

from zoo.cache.block_summary import BlockSummaryLayer
from zoo.cache.kernel_state import row_blocks
from zoo.ops import by_row_span, expand_kv, softmax_attention
from zoo.ops.moba import decode_attention, masked_block_mean, moba_attention, moba_flops
from zoo.ops.moba.naive import moba_allowed
from zoo.variant import AttentionCall, Param, Variant


class MoBAAttention(Variant):
    name = "moba"
    exact = True  # softmax attention restricted to the keys it selects (its reference)
    grouped_kv = True  # decoding gathers the chosen blocks from the grouped cache; the full forward expands
    supports_causal = True
    supports_bidirectional = False
    supports_dropout = True
    time_complexity = "O(n²·d/B + n·k·B·d)"
    memory_complexity = "O(n·k·d)"
    params = {
        "block_size": Param(512, int, "keys per block (B)", min=1),
        "top_k": Param(3, int, "earlier blocks each query reads besides its own (k)", min=0),
    }
    test_params = {"block_size": 8, "top_k": 2}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        layer = call.cache
        if call.decoding and isinstance(layer, MoBALayer):  # grouped keys: gathered per query head, never expanded
            means, filled = layer.block_summaries(call.padding_mask, call.row_start, q.shape[1])
            return decode_attention(q, k, v, call, self.block_size, self.top_k, means, filled)
        return by_row_span(self._attend_span, q, *expand_kv(k, v, q.shape[1]), call)

    def _attend_span(self, q, k, v, call: AttentionCall) -> torch.Tensor:
        return moba_attention(q, k, v, call, self.block_size, self.top_k)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Dense softmax attention over exactly the keys the kernel's selection names (O(n²), tests only)."""

        def restricted(q, k, v, call: AttentionCall) -> torch.Tensor:
            allowed = moba_allowed(q, k, call, self.block_size, self.top_k)
            return softmax_attention(q, k, v, allowed, call.scaling)

        return by_row_span(restricted, q, k, v, call)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = True) -> float:
        return moba_flops(n, heads, head_dim, self.block_size, self.top_k)

    def cache_layer(self, layer_idx: int, config) -> MoBALayer:
        return MoBALayer(self.block_size)


class MoBALayer(BlockSummaryLayer):
    """Every key and, per row and KV head, the mean key of each complete block counted from the row's first real
    token (``means`` (B, H_kv, J, D) fp32; ``filled``, ``summarized``, ``row_start`` as
    :class:`zoo.cache.block_summary.BlockSummaryLayer`), with the arithmetic of the full forward
    (:func:`zoo.ops.moba.masked_block_mean`)."""

    summary_names = ("means",)

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size, block_size)
        self.block_size = block_size

    def empty_summaries(self) -> tuple[torch.Tensor, ...]:
        batch, kv_heads, _, dim = self.keys.shape
        return (self.keys.new_zeros(batch, kv_heads, 0, dim, dtype=torch.float32),)

    def block_summaries(
        self, padding_mask: torch.Tensor | None, row_start: torch.Tensor | None, heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(means (B, heads, J, D) fp32, filled (B, J) bool) of the complete blocks of each row, brought up to date:
        O(new tokens · d) amortized, plus repeating the means to the ``heads`` query heads."""
        block = self.block_size

        def summarize(numbers: torch.Tensor, starts: torch.Tensor):
            blocks, real = row_blocks(self.keys, starts, padding_mask, numbers, block, block)
            means, counts = masked_block_mean(blocks.float(), real[:, None])
            return (means,), counts[:, 0] > 0

        (means,), filled = self.summaries(self.row_starts(row_start), summarize)
        groups = heads // self.keys.shape[1]
        return (means.repeat_interleave(groups, 1) if groups > 1 else means), filled
