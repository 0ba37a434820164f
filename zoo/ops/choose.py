"""Hard content-based choices (MoBA's and NSA's blocks, DSA's tokens) made chunk by chunk of queries: the scores of
one chunk exist at a time (never queries x keys), and no gradient flows through the choice. Attention over the
blocks chosen is :mod:`zoo.ops.chosen_blocks`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zoo.ops import limits


def select_by_query_chunks(select: Callable[[slice], tuple[torch.Tensor, torch.Tensor]], count: int,
                           scores_per_query: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``select(rows) -> (index, chosen)`` for chunks of the ``count`` queries holding about
    ``limits.SCORE_CHUNK_ELEMENTS`` scores (``scores_per_query`` each), under no_grad, concatenated along the query
    dimension ``dim``."""
    step = max(1, limits.SCORE_CHUNK_ELEMENTS // max(1, scores_per_query))
    indices, chosen = [], []
    with torch.no_grad():
        for start in range(0, count, step):
            index, ok = select(slice(start, min(start + step, count)))
            indices.append(index)
            chosen.append(ok)
    return torch.cat(indices, dim), torch.cat(chosen, dim)


def top_blocks(scores: torch.Tensor, eligible: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` eligible blocks of the highest score, ties to the earlier block.

    scores (..., nb) fp32; eligible broadcastable to it. Returns (blocks (..., k') long, chosen (..., k') bool) with
    k' = min(top_k, nb); a slot is not chosen when fewer blocks are eligible."""
    count = min(top_k, scores.shape[-1])
    scores = scores.masked_fill(~eligible, float("-inf"))
    ranked, order = scores.sort(dim=-1, descending=True, stable=True)
    return order[..., :count], ranked[..., :count] > float("-inf")
