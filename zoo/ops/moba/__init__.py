"""Mixture of Block Attention (MoBA): the kernel over one row span (:mod:`.kernel`; its kernel choice, CPU flash by
key block, one gathered entry per query, or FlexAttention where the backend setting picks it (:func:`moba_flex`), is
the first line of :func:`moba_attention`), the decoding step
(:mod:`.decode`) and the rule written out (:mod:`.naive`, the tests' oracle)."""

from zoo.ops.moba.decode import decode_attention
from zoo.ops.moba.kernel import (
    block_means,
    masked_block_mean,
    moba_attention,
    moba_flex,
    moba_flops,
    moba_selection,
    select_blocks,
)

__all__ = [
    "block_means",
    "decode_attention",
    "masked_block_mean",
    "moba_attention",
    "moba_flex",
    "moba_flops",
    "moba_selection",
    "select_blocks",
]
