"""Training DSA's lightning indexer: KL(p_t ‖ softmax_s I(t, s)) with p_t the main attention's probabilities summed
over heads and L1-normalised (a detached target), over each query's selected keys (:func:`indexer_kl`, the paper's
sparse stage) or over every eligible key (:func:`dense_indexer_kl`, the dense warm-up). Gradients reach the indexer's
inputs only."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from zoo.ops import limits
from zoo.ops.dsa.kernel import gather_rows, indexer_scores, query_chunks


def indexer_kl(q: torch.Tensor, k: torch.Tensor, index_q: torch.Tensor, index_w: torch.Tensor,
               index_k: torch.Tensor, index: torch.Tensor, chosen: torch.Tensor, scale: float,
               query_real: torch.Tensor | None = None, target: torch.Tensor | None = None) -> torch.Tensor:
    """The indexer's loss: mean over real queries of KL(p_t ‖ softmax over the selected keys of I(t, ·)), p_t the main
    attention's probabilities over the same keys summed over heads and L1-normalised (no gradient). Gradients reach
    ``index_q``, ``index_w`` and ``index_k`` only. q (B, H, Q, D); k (B, H, n, D); selection (B, Q, k'); ``target``
    (B, Q, k') those probabilities if already known (:func:`token_attention`'s ``with_target``)."""
    total = q.new_zeros((), dtype=torch.float32)
    for rows in query_chunks(q, index.shape[-1]):
        picked, ok = index[:, rows], chosen[:, rows]
        if target is not None:
            part = target[:, rows]
        else:
            with torch.no_grad():
                scores = torch.einsum("bhqd,bhqkd->bhqk", q[:, :, rows].float(), gather_rows(k, picked).float()) * scale
                probs = torch.softmax(scores.masked_fill(~ok[:, None], float("-inf")), -1).nan_to_num(0.0).sum(1)
                part = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
        keys = index_k.float()[torch.arange(index_k.shape[0], device=q.device)[:, None, None], picked]
        logits = torch.einsum("bqhd,bqkd->bqhk", index_q[:, rows].float(), keys).relu()
        scores = torch.einsum("bqhk,bqh->bqk", logits, index_w[:, rows].float())
        log_probs = torch.log_softmax(scores.masked_fill(~ok, float("-inf")), -1)
        kl = (part * (part.clamp_min(1e-30).log() - log_probs)).masked_fill(~ok, 0.0).sum(-1)  # (B, C)
        if query_real is not None:
            kl = kl * query_real[:, rows]
        total = total + kl.sum()
    real = query_real.sum() if query_real is not None else q.shape[0] * q.shape[2]
    return total / max(float(real), 1.0)


def dense_indexer_kl(q: torch.Tensor, k: torch.Tensor, index_q: torch.Tensor, index_w: torch.Tensor,
                     index_k: torch.Tensor, scale: float, key_real: torch.Tensor | None = None) -> torch.Tensor:
    """The dense warm-up's loss: mean over real queries of KL(p_t ‖ softmax over every eligible key of I(t, ·)), p_t
    the dense causal attention's probabilities summed over heads and L1-normalised (no gradient). Chunk by chunk of
    queries, each chunk recomputed in the backward: nothing of size queries x keys is kept. q (B, H, Q, D) (the last
    Q of the keys), k (B, H, n, D), indexer inputs as :func:`select_tokens`, ``key_real`` (B|1, n) bool or None."""
    batch, heads, count, _ = q.shape
    n = k.shape[-2]
    positions = torch.arange(n - count, n, device=q.device)
    real = key_real if key_real is not None else torch.ones(1, n, dtype=torch.bool, device=q.device)
    step = max(1, limits.SCORE_CHUNK_ELEMENTS // max(1, batch * max(heads, index_q.shape[2]) * n))
    total = q.new_zeros((), dtype=torch.float32)
    for start in range(0, count, step):
        rows = slice(start, min(start + step, count))
        total = total + checkpoint(_dense_chunk_kl, q[:, :, rows], k, index_q[:, rows], index_w[:, rows], index_k,
                                   positions[rows], real, scale, use_reentrant=False)
    queries = real[:, n - count :].expand(batch, count).sum()
    return total / queries.clamp_min(1).float()


def _dense_chunk_kl(q, k, index_q, index_w, index_k, positions, real, scale: float) -> torch.Tensor:
    """Σ over the chunk's real queries of KL(dense attention ‖ indexer) over their eligible keys."""
    n = k.shape[-2]
    eligible = (torch.arange(n, device=q.device) <= positions[:, None])[None] & real[:, None, :]  # (B|1, C, n)
    with torch.no_grad():
        scores = torch.einsum("bhcd,bhnd->bhcn", q.float(), k.float()) * scale
        probs = torch.softmax(scores.masked_fill(~eligible[:, None], float("-inf")), -1).nan_to_num(0.0).sum(1)
        target = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
    log_probs = torch.log_softmax(indexer_scores(index_q, index_w, index_k).masked_fill(~eligible, float("-inf")), -1)
    kl = (target * (target.clamp_min(1e-30).log() - log_probs)).masked_fill(~eligible, 0.0).sum(-1)
    return (kl * real[:, positions]).sum()
