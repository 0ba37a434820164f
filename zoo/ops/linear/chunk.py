"""Kernelized (linear) attention from non-negative feature maps: ``out = φ(q) (φ(k)ᵀ v) / (φ(q) · Σ φ(k))``.

Shared by ``performer`` (random softmax features) and ``linear`` (elu + 1). Bidirectional attention costs
O(n·m·d); causal attention uses **chunked prefix sums**: inside a chunk a masked chunk x chunk product, across
chunks a running ``m x d`` state summed chunk by chunk, so nothing of size n·m·d (a naive cumulative sum) or
n x n is ever built. Accumulation is fp32 (fp64 for fp64 inputs) even for bf16/fp16 inputs or under autocast. The
definition it implements: :mod:`zoo.ops.linear.naive`.
"""

from __future__ import annotations

import math

import torch

from zoo.ops.blocked import split_blocks
from zoo.ops.dense import pad_to_multiple


def linear_attention(
    q_features: torch.Tensor,
    k_features: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    key_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    state: dict | None = None,
) -> torch.Tensor:
    """Normalized linear attention. Returns (B, H, Nq, D) in ``v``'s dtype.

    q_features (B, H, Nq, M) and k_features (B, H, N, M) must be non-negative; v is (B, H, N, D).
    ``key_mask`` (B, N) bool, True = real key: masked keys contribute nothing (their features and values are
    zeroed, even if inf/NaN). Causal queries are aligned to the end of the keys (a KV cache holds ``N - Nq``
    earlier tokens). A query with nothing to attend (zero denominator) outputs zeros, never NaN.

    ``state`` (causal only; a recurrent cache's dict): the keys are the new tokens only and the earlier ones are
    summarized in ``state["sums"]`` = Σ φ(k)ᵀ [v, 1] (B, H, M, D + 1) in the compute dtype (absent: no earlier
    token); it is read first and replaced by the sums including these keys.
    """
    _check_shapes(q_features, k_features, v, key_mask)
    compute = torch.float64 if v.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=v.device.type, enabled=False):
        phi_q, phi_k, values = q_features.to(compute), k_features.to(compute), v.to(compute)
        if key_mask is not None:  # zero both, so inf/NaN in padded positions cannot reach real outputs
            masked = ~key_mask[:, None, :, None]
            phi_k, values = phi_k.masked_fill(masked, 0.0), values.masked_fill(masked, 0.0)
        # A ones column appended to v gives the numerator and the denominator from the same matmuls.
        values = torch.cat([values, values.new_ones(*values.shape[:-1], 1)], dim=-1)
        if causal:
            chunk = chunk_size or default_chunk_size(phi_k.shape[-1], v.shape[-1])
            initial = None if state is None else state.get("sums")
            summed, total = _causal(phi_q, phi_k, values, chunk, initial)
            if state is not None:
                state["sums"] = total
        elif state is not None:
            raise ValueError("linear_attention: a recurrent state needs causal attention")
        else:  # state as (valuesᵀ φ(k))ᵀ: its backward writes φ(k)'s gradient contiguous, with no transpose copy
            summed = torch.matmul(phi_q, torch.matmul(values.transpose(-1, -2), phi_k).transpose(-1, -2))
        numerator, denominator = summed.split([v.shape[-1], 1], dim=-1)
        out = numerator / denominator.clamp_min(torch.finfo(compute).tiny)
    return out.to(v.dtype)


def default_chunk_size(num_features: int, head_dim: int) -> int:
    """Chunk length balancing the chunk x chunk part (∝ c·(m + d)) against the state part (∝ m·d).

    Rounded to a power of two in [32, 256]: larger chunks run bigger, more efficient matmuls.
    """
    balanced = 2 * num_features * (head_dim + 1) / (num_features + head_dim + 1)
    return int(min(256, max(32, 2 ** round(math.log2(balanced)))))


def linear_attention_flops(n: int, num_features: int, head_dim: int, causal: bool, chunk_size: int) -> float:
    """Forward FLOPs of :func:`linear_attention` for one head (feature maps excluded)."""
    state_and_readout = 2 * 2.0 * n * num_features * (head_dim + 1)  # φ(k)ᵀ v and φ(q) · state
    if not causal:
        return state_and_readout
    return state_and_readout + 2.0 * n * min(chunk_size, n) * (num_features + head_dim + 1)  # chunk x chunk part


def _causal(phi_q: torch.Tensor, phi_k: torch.Tensor, values: torch.Tensor, chunk_size: int,
            initial: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_{j ≤ i} (φ(q_i)·φ(k_j)) values_j for every query i, chunk by chunk, plus φ(q_i)·``initial`` (the sums
    of earlier tokens, (B, H, M, D + 1)); also returns the sums over all keys, ``initial`` included."""
    q_len, kv_len = phi_q.shape[-2], phi_k.shape[-2]
    if q_len < kv_len:  # queries sit at the end: earlier positions get zero features and are dropped below
        phi_q = torch.cat([phi_q.new_zeros(*phi_q.shape[:-2], kv_len - q_len, phi_q.shape[-1]), phi_q], dim=-2)
    chunk = min(chunk_size, kv_len)  # never pad a short input up to a chunk
    q_chunks, k_chunks, v_chunks = (split_blocks(pad_to_multiple(t, chunk), chunk) for t in (phi_q, phi_k, values))
    # Across chunks: the state before chunk g is Σ_{g' < g} φ(k_g')ᵀ values_g' (an m x (d+1) matrix per chunk):
    # per-chunk sums, an inclusive cumsum over chunks, shifted by one chunk.
    per_chunk = torch.matmul(v_chunks.transpose(-1, -2), k_chunks).transpose(-1, -2)
    running = per_chunk.cumsum(dim=2)
    if initial is not None:
        running = running + initial[:, :, None]
    total = running[:, :, -1]
    before = torch.cat([initial[:, :, None] if initial is not None else torch.zeros_like(running[:, :, :1]),
                        running[:, :, :-1]], dim=2)
    from_earlier_chunks = torch.matmul(q_chunks, before)
    # Inside each chunk: the causal chunk x chunk kernel matrix, added to the state's share in one fused call.
    weights = torch.matmul(q_chunks, k_chunks.transpose(-1, -2)).tril_()
    summed = torch.baddbmm(from_earlier_chunks.flatten(0, 2), weights.flatten(0, 2), v_chunks.flatten(0, 2))
    summed = summed.view(*v_chunks.shape)
    summed = summed.flatten(2, 3)[:, :, :kv_len]
    return summed[:, :, kv_len - q_len :], total


def _check_shapes(
    q_features: torch.Tensor, k_features: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> None:
    if q_features.dim() != 4 or k_features.dim() != 4 or v.dim() != 4:
        raise ValueError("linear_attention expects 4-D (batch, heads, seq, dim) features and values")
    if q_features.shape[-1] != k_features.shape[-1]:
        raise ValueError(
            f"query and key feature sizes differ ({q_features.shape[-1]} vs {k_features.shape[-1]}): "
            "compute both with the same feature map"
        )
    if k_features.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"key features {tuple(k_features.shape)} and values {tuple(v.shape)} disagree on (B, H, N)")
    if key_mask is not None and key_mask.shape != (v.shape[0], v.shape[-2]):
        raise ValueError(f"key_mask must be (batch, kv_len) = {(v.shape[0], v.shape[-2])}, got {tuple(key_mask.shape)}")
