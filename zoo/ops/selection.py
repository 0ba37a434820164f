"""Hard content-based selections (MoBA's blocks, DSA's tokens) made chunk by chunk of queries: the scores of one
chunk exist at a time (never queries x keys), and no gradient flows through the choice."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Scores per selection chunk (4 MB in fp32).
SCORE_CHUNK_ELEMENTS = 2**20


def select_by_query_chunks(select: Callable[[slice], tuple[torch.Tensor, torch.Tensor]], count: int,
                           scores_per_query: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``select(rows) -> (index, chosen)`` for chunks of the ``count`` queries holding about SCORE_CHUNK_ELEMENTS
    scores (``scores_per_query`` each), under no_grad, concatenated along the query dimension ``dim``."""
    step = max(1, SCORE_CHUNK_ELEMENTS // max(1, scores_per_query))
    indices, chosen = [], []
    with torch.no_grad():
        for start in range(0, count, step):
            index, ok = select(slice(start, min(start + step, count)))
            indices.append(index)
            chosen.append(ok)
    return torch.cat(indices, dim), torch.cat(chosen, dim)
