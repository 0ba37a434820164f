"""Shared attention kernels for variants -- a leaf: they see :class:`zoo.call.AttentionCall` and
:class:`zoo.pattern.Pattern`, never a variant. GQA expansion, masks and softmax attention (``dense``), blocked attention
(``blocked``), chunked gathered-block attention (``gathered``), block-sparse attention by key block and by runs of keys
on the CPU flash kernels (``block_grouped``: MoBA's and NSA's blocks, NSA's window), unions of key sets merged into one
softmax (``union``), the CPU flash wrappers (``flash``) and their counterparts with attention dropout (``dropout``:
per-chunk masks redrawn in the backward, never stored), linear attention by chunked prefix sums (``linear``), few
queries over their selected keys for decoding (``selected``), each row over its own real tokens (``spans``), any
block-hinted pattern on those kernels (``patterned``), FlexAttention from a pattern (``flex``) and process-independent
seeds (``seeds``)."""

from zoo.ops.blocked import (
    blocked_attention,
    rows_attention,
    split_blocks,
)
from zoo.ops.dense import (
    allowed_mask,
    expand_kv,
    in_head_groups,
    pad_to_multiple,
    safe_softmax,
    sdpa_real_tokens_first,
    softmax_attention,
)
from zoo.ops.gathered import gathered_attention
from zoo.ops.linear import default_chunk_size, linear_attention, linear_attention_flops, linear_attention_reference
from zoo.ops.seeds import stream_seed
from zoo.ops.selected import selected_attention
from zoo.ops.spans import by_row_span, row_spans
from zoo.ops.union import GatheredPart, KeyPart, band_part, union_attention

__all__ = [
    "GatheredPart",
    "KeyPart",
    "allowed_mask",
    "band_part",
    "blocked_attention",
    "by_row_span",
    "default_chunk_size",
    "expand_kv",
    "gathered_attention",
    "in_head_groups",
    "linear_attention",
    "linear_attention_flops",
    "linear_attention_reference",
    "pad_to_multiple",
    "row_spans",
    "rows_attention",
    "safe_softmax",
    "sdpa_real_tokens_first",
    "selected_attention",
    "softmax_attention",
    "split_blocks",
    "stream_seed",
    "union_attention",
]
