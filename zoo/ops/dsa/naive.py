"""DSA written out, the tests' oracles: the lightning indexer's top-k rule one query at a time
(:func:`dsa_naive_mask`, fp64 scores), attention over those keys (:func:`dsa_naive`), and the dense mask of a
selection the kernel made (:func:`selected_mask`, the variant's ``reference``). O(n²) or slower, tests only."""

from __future__ import annotations

import torch

from zoo.ops.dense import softmax_attention


def dsa_naive_mask(index_q, index_w, index_k, padding_mask: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """(B, 1, n, n) bool: I(t, s) = Σ_j w_tj ReLU(q^I_tj · k^I_s) (``index_q`` (B, n, h, d_I), ``index_w`` (B, n, h),
    ``index_k`` (B, n, d_I)), a Python loop per query; the ``top_k`` real keys s ≤ t win, ties to the later key."""
    batch, n, heads, _ = index_q.shape
    mask = torch.ones(batch, n, dtype=torch.bool) if padding_mask is None else padding_mask
    allowed = torch.zeros(batch, 1, n, n, dtype=torch.bool)
    for b in range(batch):
        for t in range(n):
            ranked = []
            for s in range(t + 1):
                if mask[b, s]:
                    score = sum(float(index_w[b, t, j]) * max(float(index_q[b, t, j] @ index_k[b, s]), 0.0)
                                for j in range(heads))
                    ranked.append((-score, -s))
            for _, minus_s in sorted(ranked)[:top_k]:
                allowed[b, 0, t, -minus_s] = True
    return allowed


def dsa_naive(q, k, v, index_q, index_w, index_k, padding_mask, top_k: int, scale: float) -> torch.Tensor:
    """(B, H, n, Dv): softmax attention over :func:`dsa_naive_mask`'s keys, padded query rows zero."""
    out = softmax_attention(q, k, v, dsa_naive_mask(index_q, index_w, index_k, padding_mask, top_k), scale)
    return out if padding_mask is None else out.masked_fill(~padding_mask[:, None, :, None], 0.0)


def selected_mask(index: torch.Tensor, chosen: torch.Tensor, n: int) -> torch.Tensor:
    """(B, Q, n) bool from a selection (B, Q, k'): O(Q·n), for references and tests."""
    mask = torch.zeros(*index.shape[:-1], n, dtype=torch.long, device=index.device)
    return mask.scatter_add_(-1, index, chosen.long()) > 0
