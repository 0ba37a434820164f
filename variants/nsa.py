"""``nsa``: Native Sparse Attention (Yuan et al. 2025, DeepSeek; arXiv 2502.11089), causal only.

Three branches per query t, each its own softmax, mixed by per-token, per-head gates:
o_t = g_cmp·o_cmp + g_slc·o_slc + g_win·o_win, g = sigmoid(a learned linear map of the layer's input hidden state,
3 per query head; ``attention_zoo.gate``).

* compressed: blocks of l = ``compress_block`` keys every d = ``compress_stride`` tokens, each compressed to one key
  (and one value) by a learned map φ (``attention_zoo.key_compressor`` / ``value_compressor``, one per layer shared
  by the KV heads): the mean of the block's l keys plus a small MLP over them with a learned intra-block position
  embedding, φ(K) = mean_i(k_i) + W₂·GELU(W₁·vec(K + P)) (W₁: l·d_h → d_h; the mean makes a fresh φ a mean-pooling
  of the block, as for a retrofit). Query t reads (softmax) the compressed blocks that end at or before t.
* selection: the compressed branch's probabilities of query t summed into selection blocks of l' = ``select_block``
  tokens (each compressed block counted once per stride segment it shares with the block: the paper's eq. 9) and over
  the query heads of a GQA group (a group shares its selection). The first block and the two local ones (t's own,
  causal inside, and the one before) are always read, the highest-scoring others (ties to the earlier block) up to
  ``top_n`` blocks; query t reads their tokens with exact softmax.
* window: the last ``window`` tokens.

Blocks count from each row's first real token (:func:`zoo.ops.by_row_span`), so padding changes nothing. The
selection is a hard choice (no gradient); q, k, v, φ and the gates get gradients through the three softmaxes and the
mix. Bidirectional calls are refused (every branch is defined over the past).

Kernel (:mod:`zoo.ops.nsa`): compressed scores chunk by chunk of queries (O(n²·d_h/d), never n x n, recomputed in
the backward), the selection from the same scores, the selected tokens (O(n·top_n·l'·d_h)) and the window
(O(n·w·d_h)). On CPU the three branches run flash kernels with a KV group's heads together: the selected blocks by
key block (:func:`zoo.ops.block_grouped.block_grouped_attention`, MoBA's kernel), the window as runs of keys.
:meth:`NSAAttention.reference` is the three branches as dense softmaxes restricted to the kernel's own choice, mixed
by the same gates (tests only).

Decoding (:class:`NSALayer`): every key and value plus, per row and KV head, the compressed key and value of every
complete block (O(n/d) extra), each compressed once when the kernel first asks after it completes; a step costs
O(n/d·d_h + top_n·l'·d_h + w·d_h).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.cache.block_summary import BlockSummaryLayer
from zoo.cache.kernel_state import complete_blocks, row_blocks
from zoo.modules import gate_source
from zoo.ops import by_row_span
from zoo.ops.nsa import NSABlocks, mix, nsa_branches, nsa_decode_branches, nsa_flops
from zoo.ops.nsa.naive import nsa_reference_branches
from zoo.variant import AttentionCall, LayerWeights, Param, Variant, VariantParameterError


class NSACompressor(nn.Module):
    """φ: the l tokens of a block (..., l, d_h) -> one (..., d_h): their mean plus W₂·GELU(W₁·vec(K + P))."""

    def __init__(self, block: int, dim: int) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.zeros(block, dim))  # intra-block position embedding
        self.hidden = nn.Linear(block * dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        x = blocks.to(self.out.weight.dtype)
        mixed = self.out(F.gelu(self.hidden((x + self.position).flatten(-2))))
        return (x.mean(-2) + mixed).to(blocks.dtype)


class NSAWeights(LayerWeights):
    """One layer's compression maps (keys, values) and gates (hidden -> 3 per query head, with bias)."""

    needs_hidden_states = True

    def __init__(self, hidden_size: int, heads: int, kv_heads: int, head_dim: int, block: int) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.key_compressor = NSACompressor(block, head_dim)
        self.value_compressor = NSACompressor(block, head_dim)
        self.gate = nn.Linear(hidden_size, 3 * heads)

    def gates(self, k: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
        """(B, H, Q, 3) gates of the last ``count`` tokens: from the hidden states inside a model; called alone, from
        the keys with the heads merged (:func:`zoo.modules.gate_source`)."""
        hidden = self.hidden_states
        source = gate_source(
            None if hidden is None else hidden[:, -count:], k[..., -count:, :], self.gate.in_features, "nsa"
        )
        gates = torch.sigmoid(self.gate(source.to(self.gate.weight.dtype)))
        return gates.unflatten(-1, (-1, 3)).transpose(1, 2).to(dtype)

    def compress_rows(
        self, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, padding_mask, numbers, geometry: NSABlocks
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Compressed keys/values (B, H_kv, J, d_h) of blocks ``numbers`` (J,) of each row, counted from ``starts``
        (B,), over k/v (B, H_kv, n, d_h), and ``filled`` (B, J): complete and holding a real token."""
        out = []
        for x, compressor in ((k, self.key_compressor), (v, self.value_compressor)):
            blocks, real = row_blocks(x, starts, padding_mask, numbers, geometry.compress, geometry.stride)
            out.append(compressor(blocks * real[:, None, :, :, None].to(blocks.dtype)))
        complete = complete_blocks(k.shape[-2], starts, geometry.compress, geometry.stride)
        return out[0], out[1], real.any(-1) & (numbers < complete[:, None])


class NSAAttention(Variant):
    name = "nsa"
    exact = True  # each branch is softmax attention restricted to its own choice (its reference)
    supports_causal = True
    supports_bidirectional = False
    supports_dropout = True
    time_complexity = "O(n²·d/s + n·(k·b + w)·d)"
    memory_complexity = "O(n·(k + d))"
    params = {
        "compress_block": Param(32, int, "tokens per compressed block (l)", min=1),
        "compress_stride": Param(16, int, "tokens between compressed blocks (d)", min=1),
        "select_block": Param(64, int, "tokens per selection block (l')", min=1),
        "top_n": Param(16, int, "selection blocks each query reads, the first and 2 local ones included", min=3),
        "window": Param(512, int, "sliding window: the last `window` tokens", min=1),
    }
    test_params = {"compress_block": 8, "compress_stride": 4, "select_block": 16, "top_n": 4, "window": 16}

    def check_config(self) -> None:
        stride = self.compress_stride
        for pname in ("compress_block", "select_block"):
            value = getattr(self, pname)
            if value % stride:
                raise VariantParameterError(
                    f"attention-zoo variant 'nsa': {pname!r}={value} must be a multiple of "
                    f"'compress_stride'={stride} (compressed blocks are scored per stride segment); e.g. "
                    f"{pname}={max(1, value // stride) * stride}."
                )

    @property
    def geometry(self) -> NSABlocks:
        return NSABlocks(self.compress_block, self.compress_stride, self.select_block, self.top_n, self.window)

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> NSAWeights:
        kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return NSAWeights(config.hidden_size, num_heads, kv_heads, head_dim, self.compress_block)

    def cache_layer(self, layer_idx: int, config) -> NSALayer:
        return NSALayer(self.geometry)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = True) -> float:
        return nsa_flops(n, heads, head_dim, self.geometry)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return self._run(nsa_branches, q, k, v, call)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """The three branches as dense softmaxes over exactly the compressed blocks, tokens and window the kernel
        reads, mixed by the same gates (O(n²), tests only)."""
        return self._run(nsa_reference_branches, q, k, v, call)

    def _run(self, branches, q, k, v, call: AttentionCall) -> torch.Tensor:
        weights = self.layer_weights(call)
        gates = weights.gates(k, q.shape[-2], q.dtype)
        groups = q.shape[1] // weights.kv_heads
        if call.decoding:
            return mix(gates, self._decode_branches(q, k, v, call, weights, groups))
        geometry, dim = self.geometry, q.shape[-1]

        def span(q_gates, k, v, call: AttentionCall) -> torch.Tensor:  # the gates ride along with the queries
            q, gates = q_gates[..., :dim], q_gates[..., dim:]
            parts = branches(q, k, v, call, geometry, weights.key_compressor, weights.value_compressor, groups)
            return mix(gates, parts)

        return by_row_span(span, torch.cat([q, gates], -1), k, v, call)

    def _decode_branches(self, q, k, v, call: AttentionCall, weights: NSAWeights, groups: int):
        """New queries over every earlier key: compressed blocks from the variant's cache, or computed afresh."""
        geometry, n = self.geometry, k.shape[-2]
        starts = (
            call.row_start.to(q.device)
            if call.row_start is not None
            else torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
        )
        layer = call.cache
        if isinstance(layer, NSALayer):
            keys, values, filled = layer.compressed_blocks(call.padding_mask, starts, weights)
        else:
            numbers = torch.arange(
                int(complete_blocks(n, starts, geometry.compress, geometry.stride).max()), device=q.device
            )
            keys, values, filled = weights.compress_rows(
                k[:, ::groups], v[:, ::groups], starts, call.padding_mask, numbers, geometry
            )
        return nsa_decode_branches(q, k, v, call, geometry, keys, values, filled, starts)


class NSALayer(BlockSummaryLayer):
    """Every key and, per row and KV head, the compressed key and value of each complete block counted from the
    row's first real token (``compressed_keys``/``compressed_values`` (B, H_kv, J, d_h); ``filled``, ``summarized``,
    ``row_start`` as :class:`zoo.cache.block_summary.BlockSummaryLayer`), compressed with the layer's maps."""

    summary_names = ("compressed_keys", "compressed_values")

    def __init__(self, geometry: NSABlocks) -> None:
        super().__init__(geometry.compress, geometry.stride)
        self.geometry = geometry

    def empty_summaries(self) -> tuple[torch.Tensor, ...]:
        return self.keys[:, :, :0, :], self.values[:, :, :0, :]

    def compressed_blocks(self, padding_mask: torch.Tensor | None, starts: torch.Tensor, weights: NSAWeights):
        """(keys, values (B, H_kv, J, d_h), filled (B, J)) brought up to date: O(new tokens · d_h) amortized."""

        def summarize(numbers: torch.Tensor, starts: torch.Tensor):
            with torch.no_grad():
                keys, values, filled = weights.compress_rows(
                    self.keys, self.values, starts, padding_mask, numbers, self.geometry
                )
            return (keys, values), filled

        (keys, values), filled = self.summaries(starts, summarize)
        return keys, values, filled
