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
    """The ``top_k`` eligible blocks of the highest score, ties to the earlier block (MoBA's and NSA's choice):
    :func:`top_positions` with ``ties_to_later=False``."""
    return top_positions(scores, eligible, top_k, ties_to_later=False)


def top_positions(scores: torch.Tensor, eligible: torch.Tensor, top_k: int,
                  ties_to_later: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` eligible positions (last dimension) of the highest score, equal scores to the later position
    (``ties_to_later``) or to the earlier one.

    scores (..., n) fp32, finite or +inf; eligible broadcastable to it. Returns (index (..., k') long ascending,
    chosen (..., k') bool), k' = min(top_k, n); unchosen slots (fewer eligible positions) hold index n - 1. One
    ``topk`` of the scores; only the rows holding more positions at their k'-th score than they take (a tie to break,
    or fewer eligible positions than k') are decided again by :func:`_ranked_positions`, whose 64-bit keys rank equal
    scores by position."""
    n = scores.shape[-1]
    count = min(top_k, n)
    scores = scores.masked_fill(~eligible, float("-inf"))
    if count == 0:
        none = scores.new_zeros(*scores.shape[:-1], 0, dtype=torch.long)
        return none, none.bool()
    values, index = scores.topk(count, dim=-1)
    index = index.sort(dim=-1).values
    chosen = torch.ones_like(index, dtype=torch.bool)
    unsure = ((scores >= values[..., -1:]).sum(-1) != count) | (values[..., -1] == float("-inf"))
    if bool(unsure.any()):
        rows = unsure.nonzero(as_tuple=True)
        index[rows], chosen[rows] = _ranked_positions(scores[rows], count, ties_to_later)
    return index, chosen


NOT_ELIGIBLE = torch.iinfo(torch.int64).min


def _ranked_positions(scores: torch.Tensor, count: int, ties_to_later: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_positions` of scores (m, n) (ineligible ones -inf) through one ``topk`` of 64-bit keys: the score's
    bits in an order-preserving integer above the position (or its mirror n - 1 - position: ties to the earlier)."""
    n = scores.shape[-1]
    bits = (scores + 0.0).view(torch.int32).long()  # + 0.0: -0.0 becomes 0.0, the same score
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # integers in the floats' order
    positions = torch.arange(n, device=scores.device)
    keys = (ordered << 32) | (positions if ties_to_later else n - 1 - positions)
    keys = keys.masked_fill_(scores == float("-inf"), NOT_ELIGIBLE).topk(count, dim=-1, sorted=False).values
    low = keys & 0xFFFFFFFF
    index = torch.where(keys != NOT_ELIGIBLE, low if ties_to_later else n - 1 - low, n).sort(dim=-1).values
    return index.clamp(max=n - 1), index < n
