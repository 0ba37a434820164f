"""Mixture of Block Attention (MoBA, Lu et al. 2025): each query reads its own block and the ``top_k`` earlier blocks
whose mean key scores highest against it, in one softmax.

Keys are cut into blocks of ``block`` tokens counted from the row's first token (callers slice each row to its own
span, :func:`zoo.ops.by_row_span`). The gate of query t for block j is ``q_t · mean(real keys of j)``; the blocks
eligible are the complete blocks before t's own block that hold a real key. Ties are broken towards the earlier block
(a stable sort), the same in the kernel, the dense reference and decoding. The selection is made chunk by chunk of
queries (scores (chunk, blocks), never n x n) without gradient: the gate is a hard choice, as in the paper. It costs
O(n·(n / block)·d) time.

Attention, O(n·(top_k + 1)·block·d) time:

* CPU, a span without padding (the common case): grouped by key block, as the paper's kernel does. Each chosen key
  block runs one flash call with the queries that chose it (gathered: O(n·k·d), the keys are read in place), the own
  blocks one blocked causal call; the parts merge through their log-sum-exps (one softmax, exact joint gradient) and
  the backward recomputes each part from the merged output (:func:`zoo.ops.block_grouped.block_grouped_attention`,
  shared with NSA). Under attention dropout the parts run :mod:`zoo.ops.dropout`'s kernels.
* Otherwise (padding inside the span, fewer queries than keys, CUDA, fp64): one gathered entry per query over its
  blocks (:func:`zoo.ops.chosen_blocks.gathered_block_attention`).
* FlexAttention (:func:`moba_flex`) under ``zoo.attention_backend("flex")``, or under ``"auto"`` once measured to win
  (:mod:`zoo.ops.backends.choice`): the selection becomes a block mask built per call
  (:mod:`zoo.ops.backends.flex_blocks`); forward everywhere, backward on CUDA.
"""

from __future__ import annotations

import torch

from zoo.call import AttentionCall
from zoo.ops.backends.choice import compiled, content_flex, on_flex
from zoo.ops.backends.flex_blocks import chosen_blocks_attention
from zoo.ops.block_grouped import block_grouped_attention, by_key_block_applies
from zoo.ops.choose import select_by_query_chunks, top_blocks
from zoo.ops.chosen_blocks import gathered_block_attention
from zoo.ops.dense import pad_to_multiple
from zoo.ops.dropout import Dropout


def masked_block_mean(blocks: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of the real keys of each block. ``blocks`` (..., J, block, D) fp32; ``real`` broadcastable to
    (..., J, block) bool. Returns (means (..., J, D) fp32, real keys per block (..., J)). Shared by the kernel and
    the decoding cache, so both summarize a block with the same arithmetic."""
    weights = real.to(blocks.dtype)
    counts = weights.sum(-1)
    return (blocks * weights[..., None]).sum(-2) / counts.clamp_min(1.0)[..., None], counts


def block_means(k: torch.Tensor, real: torch.Tensor | None, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of ``block`` keys from position 0: (means (B, H, nb, D) fp32, holds a real key (B|1, 1, nb) bool).

    k (B, H, n, D); ``real`` (B|1, n) bool or None. The last block may be partial (it is only ever some query's own
    block, which is not scored)."""
    n = k.shape[-2]
    blocks = pad_to_multiple(k.float(), block).unflatten(-2, (-1, block))
    if real is None:
        real = torch.ones(1, n, dtype=torch.bool, device=k.device)
    real = pad_to_multiple(real, block, dim=-1, value=False).view(real.shape[0], 1, -1, block)
    means, counts = masked_block_mean(blocks, real)
    return means, counts > 0


def select_blocks(q: torch.Tensor, means: torch.Tensor, filled: torch.Tensor, own: torch.Tensor, top_k: int):
    """Each query's ``top_k`` earlier blocks, chunk by chunk of queries, without gradient.

    q (B, H, Q, D); means (B|1, H, nb, D) fp32; filled (B|1, 1|H, nb) bool: the block holds a real key; own
    (B|1, Q) long: each query's own block (only blocks before it are eligible). Returns (blocks, chosen), each
    (B, H, Q, min(top_k, nb))."""
    batch, heads, count, _ = q.shape
    numbers = torch.arange(means.shape[-2], device=q.device)

    def select(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.matmul(q[:, :, rows].float(), means.transpose(-1, -2))  # (B, H, C, nb)
        return top_blocks(scores, (numbers < own[:, None, rows, None]) & filled[:, :, None, :], top_k)

    return select_by_query_chunks(select, count, batch * heads * len(numbers), 2)


def moba_selection(q: torch.Tensor, k: torch.Tensor, call: AttentionCall, block: int, top_k: int):
    """The blocks each query reads, in the coordinates of one row span (positions 0 .. n - 1, the queries the last
    Q keys, ``call.padding_mask`` (B, n) or None): (blocks (B, H, Q, R) long, chosen (B, H, Q, R) bool, query
    positions (Q,)); the last of the R = min(top_k, nb) + 1 slots is the query's own block."""
    batch, heads, count, _ = q.shape
    n = k.shape[-2]
    positions = torch.arange(n - count, n, device=q.device)
    own = (positions // block)[None]
    means, filled = block_means(k, call.padding_mask, block)
    blocks, chosen = select_blocks(q, means, filled, own, top_k)
    own_slot = own[:, None, :, None].expand(batch, heads, count, 1)
    blocks = torch.cat([blocks, own_slot], -1)
    chosen = torch.cat([chosen, torch.ones_like(own_slot, dtype=torch.bool)], -1)
    return blocks, chosen, positions


def moba_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall, block: int, top_k: int
) -> torch.Tensor:
    """(B, H, Q, Dv): causal MoBA over one row span (see :func:`moba_selection`). The kernel choice: FlexAttention
    where the backend setting picks it (:func:`zoo.ops.backends.choice.content_flex`: forced, or measured), by key
    block on the CPU flash kernels where they take the call (:func:`zoo.ops.block_grouped.by_key_block_applies`),
    else one gathered entry per query."""
    if content_flex("moba", q, k, v, call) and (
        out := on_flex("moba", lambda: moba_flex(q, k, v, call, block, top_k, compiled()))
    ) is not None:
        return out
    blocks, chosen, positions = moba_selection(q, k, call, block, top_k)
    if by_key_block_applies(q, k, call):
        return block_grouped_attention(
            q, k, v, blocks[..., :-1], chosen[..., :-1], block, call.scaling, Dropout.of(call)
        )
    return gathered_block_attention(q, k, v, call, block, blocks, chosen, positions)


def moba_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall, block: int, top_k: int,
              compiled: bool = True) -> torch.Tensor:
    """:func:`moba_attention` on FlexAttention, whatever the backend setting: the same selection as a block mask
    (:func:`zoo.ops.backends.flex_blocks.chosen_blocks_attention`). As many queries as keys; forward and, on CUDA,
    backward (``compiled=False``: Flex's eager reference, tests only)."""
    blocks, chosen, _ = moba_selection(q, k, call, block, top_k)
    return chosen_blocks_attention(q, k, v, blocks, chosen, block, call, compiled)


def moba_flops(n: int, heads: int, head_dim: int, block: int, top_k: int) -> float:
    """Forward FLOPs at length n (causal): the gate (each query scores the blocks before its own) and attention over
    (up to) ``top_k`` whole blocks plus half its own block on average."""
    nb = -(-n // block)
    gate = 2.0 * heads * head_dim * n * (nb - 1) / 2
    keys = sum(min(top_k, j) for j in range(nb)) * block * block + n * (block + 1) / 2
    return gate + 4.0 * heads * head_dim * keys
