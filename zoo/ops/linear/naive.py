"""Linear attention as written: ``out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / Σ_j φ(q_i)·φ(k_j)`` over the keys query i may
see. :func:`linear_attention_reference` as one masked O(n²) product (the variants' ``reference``),
:func:`linear_attention_loop` one query and one key at a time (the tests' oracle for tiny n)."""

from __future__ import annotations

import torch


def linear_attention_reference(
    q_features: torch.Tensor, k_features: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None
) -> torch.Tensor:
    """The definition :func:`zoo.ops.linear.linear_attention` implements, in O(n²) (tests and the contract suite only).

    ``allowed`` is a bool mask broadcastable to (B, H, Nq, N), e.g. from :func:`zoo.ops.allowed_mask`.
    """
    weights = torch.matmul(q_features, k_features.transpose(-1, -2))
    if allowed is not None:
        weights = weights.masked_fill(~allowed, 0.0)
    return torch.matmul(weights, v) / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)


def linear_attention_loop(
    q_features: torch.Tensor, k_features: torch.Tensor, v: torch.Tensor, causal: bool, key_mask: torch.Tensor | None
) -> torch.Tensor:
    """A Python sum per query over the keys it may see (causal queries aligned to the end of the keys, ``key_mask``
    (B, N) bool or None); a query with no key outputs zeros. (B, H, Nq, D) in fp64, tiny n only."""
    batch, heads, q_len, _ = q_features.shape
    kv_len = k_features.shape[-2]
    out = torch.zeros(batch, heads, q_len, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                position = kv_len - q_len + i
                numerator, denominator = 0.0, 0.0
                for j in range(kv_len):
                    if (causal and j > position) or (key_mask is not None and not key_mask[b, j]):
                        continue
                    weight = q_features[b, h, i] @ k_features[b, h, j]
                    numerator, denominator = numerator + weight * v[b, h, j], denominator + weight
                if denominator > 0:
                    out[b, h, i] = numerator / denominator
    return out
