"""Shared attention kernels for variants -- a leaf: plain tensors, :class:`zoo.call.AttentionCall` and
:class:`zoo.pattern.Pattern` in, tensors out; never a variant, a cache or an ``nn.Module`` (those are
:mod:`zoo.modules`). Laid out as flash-linear-attention's ``fla/ops``:

* Shared machinery, flat: GQA expansion, masks and softmax attention (``dense``), blocked attention (``blocked``),
  chunked gathered-block attention (``gathered``), block-sparse attention by key block and by runs of keys on the CPU
  flash kernels (``block_grouped``), unions of key sets merged into one softmax (``union``), the CPU flash wrappers
  (``flash``) and their counterparts with attention dropout (``dropout``), hard top-k choices by query chunks
  (``choose``) and attention over the blocks chosen (``chosen_blocks``), few queries over the keys a pattern selects
  for decoding (``decode_selected``), each row over its own real tokens (``spans``), any block-hinted pattern on those
  kernels (``patterned``), the causal short convolution (``causal_conv``), recurrent-state helpers (``state``),
  process-independent seeds (``seeds``), and every chunk and size limit, named once by what it bounds (``limits``).
* One package per algorithm, each with its kernel, its decoding step where it has one and a short ``naive`` module
  (the rule written out, the tests' oracle): ``linear``, ``delta_rule``, ``gated_linear``, ``moba``, ``nsa``,
  ``dsa``. Each package's docstring says where its kernel choice (CPU chunked, fla) is made.
* Optional backends: FlexAttention from a pattern and flash-linear-attention's triton kernels (``backends``)."""

from zoo.ops.blocked import (
    blocked_attention,
    rows_attention,
    split_blocks,
)
from zoo.ops.decode_selected import selected_attention
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
