"""DeepSeek Sparse Attention (DSA): the lightning indexer's selection and attention over the selected tokens
(:mod:`.kernel`; its kernel choice, the zoo's Triton kernels on CUDA with triton installed, chunked CPU flash with a
recomputing backward, or SDPA chunks elsewhere, is the first lines of :func:`token_attention`), the indexer's
training losses (:mod:`.indexer`) and the rule written out (:mod:`.naive`, the tests' oracle). Decoding runs the same
two steps over a cache of every key."""

from zoo.ops.dsa.indexer import dense_indexer_kl, indexer_kl
from zoo.ops.dsa.kernel import dsa_flops, indexer_scores, select_tokens, token_attention, top_tokens

__all__ = [
    "dense_indexer_kl",
    "dsa_flops",
    "indexer_kl",
    "indexer_scores",
    "select_tokens",
    "token_attention",
    "top_tokens",
]
