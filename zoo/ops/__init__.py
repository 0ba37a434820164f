"""Shared attention kernels and helpers for variants: GQA expansion, masks, softmax attention, blocked
gathers (``zoo.ops.blocked``) and chunked prefix sums (``zoo.ops.prefix``)."""

from zoo.ops.blocked import (
    band_blocks,
    band_positions,
    blocked_attention,
    gather_blocks,
    rows_attention,
    split_blocks,
)
from zoo.ops.dense import allowed_mask, expand_kv, in_head_groups, pad_to_multiple, safe_softmax, softmax_attention
from zoo.ops.gathered import gathered_attention
from zoo.ops.prefix import default_chunk_size, linear_attention, linear_attention_flops, linear_attention_reference
from zoo.ops.union import GatheredPart, KeyPart, band_part, union_attention

__all__ = [
    "GatheredPart",
    "KeyPart",
    "allowed_mask",
    "band_blocks",
    "band_part",
    "band_positions",
    "blocked_attention",
    "default_chunk_size",
    "expand_kv",
    "gather_blocks",
    "gathered_attention",
    "in_head_groups",
    "linear_attention",
    "linear_attention_flops",
    "linear_attention_reference",
    "pad_to_multiple",
    "rows_attention",
    "safe_softmax",
    "softmax_attention",
    "split_blocks",
    "union_attention",
]
