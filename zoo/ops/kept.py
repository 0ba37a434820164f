"""Attention over per-(row, KV head) key sets and the scores that choose which keys a budgeted cache keeps
(:class:`zoo.cache.BudgetedLayer`).

Layout: queries ``q`` (batch, heads, Q, d); kept ``keys`` / ``values`` (batch, kv_heads, K, d), the same count K in
every (row, KV head) but different tokens; ``key_pos`` (batch, kv_heads, K) their token positions, ``key_real`` the
ones that are real tokens (not padding). Query head h reads KV head h // (heads / kv_heads) (GQA). Nothing here builds
an n x n tensor: queries go in chunks of at most :data:`KEPT_SCORES_PER_CHUNK` scores.

Every score is (batch, kv_heads, K) float32, higher = keep; definitions in README ("Bounding a pretrained model's
memory") and in each function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEPT_SCORES_PER_CHUNK = 1 << 18  # kept_attention's scores per query chunk (1 MB in fp32): a chunked prefill runs it
# at every layer and chunk, and score buffers of tens of MB, freed and made again around the cache's own allocations,
# stayed in glibc's heap (results/bench/kv/README.md, peak RSS); buffers this small are reused instead


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    batch, heads, length, dim = q.shape
    return q.reshape(batch, kv_heads, heads // kv_heads, length, dim)


def _hidden(key_pos, key_real, query_pos):
    """(B, Hk, 1, c, K) bool, the kept keys a query may not see (padding, or past its position); None when every
    query sees every key (a decoding step over real keys: no mask to build or apply)."""
    causal = bool((key_pos > query_pos.min().to(key_pos)).any())
    if not causal and bool(key_real.all()):
        return None
    hidden = ~key_real[:, :, None, None, :]
    if causal:
        hidden = hidden | (key_pos[:, :, None, None, :] > query_pos.to(key_pos)[:, None])
    return hidden


def _weights(qg, keys, key_pos, key_real, query_pos, scaling):
    """The softmax over the kept keys a query may see (real, at a position <= its own) as a ratio: exp(logit - the
    row's max), (B, Hk, G, c, K) fp32, and the row sums (B, Hk, G, c, 1) (1 for a query that sees no key: its row
    is zeros). Callers divide what they reduce it to (an output, a vote) by the sums, not the (.., K) buffer. The
    group's heads are one matrix of G x c rows against the KV head's keys (a broadcast over G copied the keys G
    times first)."""
    batch, kv_heads, group, length, dim = qg.shape
    rows = qg.reshape(batch, kv_heads, group * length, dim).float() * scaling
    logits = torch.matmul(rows, keys.float().transpose(-1, -2)).view(batch, kv_heads, group, length, -1)
    hidden = _hidden(key_pos, key_real, query_pos)
    if torch.is_grad_enabled() and (qg.requires_grad or keys.requires_grad):  # autograd: out of place
        if hidden is not None:
            logits = logits.masked_fill(hidden, float("-inf"))
        top = logits.detach().amax(dim=-1, keepdim=True)  # any shift gives the same softmax (and gradient)
        weights = torch.exp(logits - top.masked_fill(~torch.isfinite(top), 0.0))
    else:
        # decoding (no autograd): in place, one (B, Hk, G, c, K) fp32 buffer live (a chunked prefill runs this at
        # every layer and chunk; freed buffers of that size stay in the allocator's heap, in peak RSS)
        if hidden is not None:
            logits.masked_fill_(hidden, float("-inf"))
        top = logits.amax(dim=-1, keepdim=True)
        weights = logits.sub_(top.masked_fill_(~torch.isfinite(top), 0.0)).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    return weights, total.masked_fill(total == 0, 1.0)


def kept_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    key_real: torch.Tensor,
    query_pos: torch.Tensor,
    scaling: float,
    query_real: torch.Tensor | None = None,
    want_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal softmax attention of ``q`` (queries at ``query_pos`` (Q,)) over the kept keys of its KV head: the output
    (B, H, Q, d_v) and, with ``want_mass``, each key's attention mass summed over the call's real queries
    (``query_real`` (B, Q)) and the query heads of its group (H2O's column sums, chunk by chunk from each query's
    softmax), (B, Hk, K) fp32."""
    batch, heads, length, _ = q.shape
    kv_heads, kept = keys.shape[1], keys.shape[2]
    qg = _grouped(q, kv_heads)
    chunk = max(1, min(length, KEPT_SCORES_PER_CHUNK // max(1, batch * heads * kept)))
    mass = torch.zeros(batch, kv_heads, kept, device=q.device) if want_mass else None
    outs = []
    for start in range(0, length, chunk):
        stop = min(length, start + chunk)
        weights, total = _weights(qg[:, :, :, start:stop], keys, key_pos, key_real, query_pos[start:stop], scaling)
        rows = weights.to(values.dtype).view(batch, kv_heads, -1, kept)  # the group's heads as rows, as the logits
        out = torch.matmul(rows, values).view(*weights.shape[:4], values.shape[-1])
        outs.append(out / total.to(out.dtype))
        if mass is not None:
            real = 1.0 if query_real is None else query_real[:, None, None, start:stop, None].to(total)
            mass += _column_sums(weights, real / total)
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(batch, heads, length, values.shape[-1]), mass


def recent_query_attention(queries, query_pos, query_real, keys, key_pos, key_real, scaling) -> torch.Tensor:
    """The attention of the recorded recent queries over the kept keys, summed over the real queries and averaged
    over the query heads of each KV group: (B, Hk, K). TOVA's score (Oren et al. 2024; the current query alone, with
    its window of one); SnapKV's votes before pooling (the last w prompt queries)."""
    qg = _grouped(queries, keys.shape[1])
    weights, total = _weights(qg, keys, key_pos, key_real, query_pos, scaling)
    return _column_sums(weights, query_real[:, None, None, :, None].to(total) / (total * qg.shape[2]))


def _column_sums(weights: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    """sum over the group's heads and queries of ``weights`` (B, Hk, G, c, K) x ``share`` (B, Hk, G, c, 1): (B, Hk,
    K), one matrix product (no product buffer of the weights' size)."""
    batch, kv_heads, group, length, kept = weights.shape
    share = share.expand(batch, kv_heads, group, length, 1).reshape(batch, kv_heads, 1, group * length)
    return torch.matmul(share, weights.view(batch, kv_heads, -1, kept)).view(batch, kv_heads, kept)


def snapkv_scores(queries, query_pos, query_real, keys, key_pos, key_real, scaling, pool: int) -> torch.Tensor:
    """SnapKV (Li et al. 2024): the observation window's (last w queries') attention summed over the window, averaged
    over the group's heads, max-pooled over ``pool`` (odd) neighbouring kept keys (keeps clusters whole)."""
    votes = recent_query_attention(queries, query_pos, query_real, keys, key_pos, key_real, scaling)
    batch, kv_heads, kept = votes.shape
    pooled = F.max_pool1d(votes.reshape(batch * kv_heads, 1, kept), pool, stride=1, padding=pool // 2)
    return pooled.reshape(batch, kv_heads, kept)


def expected_attention_scores(queries, query_real, keys, values, key_real, scaling) -> torch.Tensor:
    """Expected Attention (Devoto et al. 2025), closed form: with future queries q ~ N(mu, Sigma) estimated from the
    recorded recent queries (per query head), E[exp(s q.k)] = exp(s mu.k + s^2 k^T Sigma k / 2); normalised over the
    kept keys (an expected softmax), averaged over the group's heads, times the value norm ||v|| (the key's share of
    the output). Simplification: the recent queries carry their own rotary phase (the paper averages the rotation
    over the coming positions)."""
    weights = query_real.to(torch.float32)[:, None, :, None]  # (B, 1, W, 1)
    count = weights.sum(dim=2, keepdim=True).clamp(min=1.0)
    qf = queries.float()
    mean = (qf * weights).sum(dim=2, keepdim=True) / count  # (B, H, 1, d)
    centred = (qf - mean) * weights
    cov = centred.transpose(-1, -2) @ centred / count  # (B, H, d, d)
    kv_heads = keys.shape[1]
    mean_g = _grouped(mean, kv_heads)[:, :, :, 0]  # (B, Hk, G, d)
    cov_g = cov.reshape(cov.shape[0], kv_heads, -1, *cov.shape[-2:])  # (B, Hk, G, d, d)
    kf = keys.float()
    linear = torch.einsum("bhgd,bhkd->bhgk", mean_g, kf) * scaling
    quadratic = torch.einsum("bhkd,bhgde,bhke->bhgk", kf, cov_g, kf) * (scaling * scaling / 2)
    logits = (linear + quadratic).masked_fill(~key_real[:, :, None, :], float("-inf"))
    expected = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=2)
    return expected * values.float().norm(dim=-1)


def knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    """KNorm (Devoto et al. 2024): keys of low L2 norm draw the most attention; keep them (score = -||k||)."""
    return -keys.float().norm(dim=-1)


def recency_scores(key_pos: torch.Tensor) -> torch.Tensor:
    """StreamingLLM (Xiao et al. 2023): nothing but the sinks and the most recent keys (score = position)."""
    return key_pos.to(torch.float32)
