"""Native Sparse Attention (NSA): the three branches over one row span (:mod:`.kernel`), the decoding step
(:mod:`.decode`) and the rule written out (:mod:`.naive`, the tests' oracles).

Kernel choice: all three branches on FlexAttention where the backend setting picks it (:func:`nsa_flex`, at the top
of :func:`nsa_branches`); otherwise per branch, at the top of its function in :mod:`.kernel`: the compressed branch
on the CPU flash kernels by query chunks where they take q's dtype, else checkpointed SDPA chunks
(:func:`compressed_branch`); the selected branch on fla's triton kernel where it applies
(:func:`zoo.ops.backends.fla.fla_nsa_kernel`), else by key block on the CPU flash kernels
(:func:`zoo.ops.block_grouped.by_key_block_applies`), else one gathered entry per query (:func:`selected_branch`);
the window by block diagonals on the CPU flash kernels without padding, else the band
kernel (:func:`window_branch`)."""

from zoo.ops.nsa.decode import nsa_decode_branches
from zoo.ops.nsa.kernel import (
    LOCAL_BLOCKS,
    Compress,
    NSABlocks,
    compress,
    compressed_branch,
    mix,
    nsa_branches,
    nsa_flex,
    nsa_flops,
    selected_branch,
    span_parts,
    window_branch,
)

__all__ = [
    "LOCAL_BLOCKS",
    "Compress",
    "NSABlocks",
    "compress",
    "compressed_branch",
    "mix",
    "nsa_branches",
    "nsa_decode_branches",
    "nsa_flex",
    "nsa_flops",
    "selected_branch",
    "span_parts",
    "window_branch",
]
