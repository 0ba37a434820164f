"""Gated linear attention: a recurrent state S (d_k x d_v per head) that decays, unnormalized,

    S_t = Diag(α_t) S_{t−1} + k_t v_tᵀ,    o_t = scale · S_tᵀ q_t

with α_t ∈ (0, 1] per key channel (GLA, Yang et al. 2024) or one α_t per head (a scalar decay: the core of
Mamba2 / SSD, and RetNet's fixed γ_h when it does not depend on the token). Plain tensors in and out: the
``gla`` variant builds q, k and log α.

:func:`gated_linear_attention` is the chunkwise form. With b_t = Σ_{s ≤ t} log α_s accumulated since the chunk
started (per channel, or per head):

    O = scale · ((Q ⊙ e^b) S + A V),   A_ts = Σ_c q_tc k_sc e^{b_tc − b_sc} (s ≤ t),
    S ← e^{b_C} ⊙ S + (K ⊙ e^{b_C − b})ᵀ V

Every exponent is ≤ 0 (b is non-increasing), so no factor overflows: A is computed from the differences
b_t − b_s directly, per channel (a C x C x d_k product per chunk: memory O(n·C·d_k), hence the small default
chunk of 16 for per-channel decay) or per head (C x C). Time O(n·C·d + n·d²); the state runs chunk after chunk,
one d_k x d_v state per chunk is kept for the backward (autograd; nothing is recomputed). fp32 accumulation (fp64
for fp64 inputs), output in ``v``'s dtype. Tokens with k = 0 and log α = 0 leave the state untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.ops.backends.fla import fla_gated_linear, fla_kernel
from zoo.ops.gated_linear.naive import gated_linear_recurrence
from zoo.ops.state import state_dtype

CHANNEL_CHUNK = 16  # per-channel decay: the chunk products are C x C x d_k
SCALAR_CHUNK = 64


def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    scale: float = 1.0,
    chunk_size: int | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, H, n, d_k); v (B, H, n, d_v); log_decay (log α ≤ 0) (B, H, n, d_k) per channel or (B, H, n) per
    head; ``initial_state`` (B, H, d_k, d_v) or None. Returns (out (B, H, n, d_v) in v's dtype, final state).
    bf16/fp16 CUDA calls run on fla's ``chunk_gla`` / ``chunk_simple_gla`` when it is installed
    (:mod:`zoo.ops.backends.fla`)."""
    per_channel = log_decay.dim() == 4
    if (kernel := fla_kernel("gla" if per_channel else "simple_gla", q, k, v)) is not None:
        return fla_gated_linear(kernel, q, k, v, log_decay, scale, initial_state)
    if k.shape[2] == 1:  # a decoding step: the definition itself, without a chunk's masks
        return gated_linear_recurrence(q, k, v, log_decay, scale, initial_state)
    dtype, out_dtype = state_dtype(v), v.dtype
    with torch.autocast(device_type=v.device.type, enabled=False):
        q, k, v, g = (x.to(dtype) for x in (q, k, v, log_decay))
        batch, heads, n, d_k = k.shape
        d_v = v.shape[-1]
        chunk = max(1, min(chunk_size or (CHANNEL_CHUNK if per_channel else SCALAR_CHUNK), n))
        pad = (-n) % chunk
        if pad:  # k = 0 and log α = 0: padded tokens change nothing
            q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
            g = F.pad(g, (0, 0, 0, pad) if per_channel else (0, pad))
        chunks = (n + pad) // chunk
        qc, kc, vc = (x.reshape(batch, heads, chunks, chunk, x.shape[-1]) for x in (q, k, v))
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
        if per_channel:
            b = g.reshape(batch, heads, chunks, chunk, d_k).cumsum(-2)
            diff = (b[..., :, None, :] - b[..., None, :, :]).masked_fill(~causal[..., None], float("-inf"))
            scores = torch.einsum("...tc,...sc,...tsc->...ts", qc, kc, diff.exp()) * scale
            queries = qc * b.exp() * scale
            state_keys = kc * (b[..., -1:, :] - b).exp()
            chunk_decay = b[..., -1, :].exp()[..., None]  # (B, H, c, d_k, 1): rows of S
        else:
            b = g.reshape(batch, heads, chunks, chunk).cumsum(-1)
            gamma = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf")).exp()
            scores = torch.matmul(qc, kc.transpose(-1, -2)) * gamma * scale
            queries = qc * b.exp()[..., None] * scale
            state_keys = kc * (b[..., -1:] - b).exp()[..., None]
            chunk_decay = b[..., -1].exp()[..., None, None]  # (B, H, c, 1, 1)
        intra = torch.matmul(scores, vc)  # (B, H, c, C, d_v): inside each chunk, all chunks at once
        state = initial_state.to(dtype) if initial_state is not None else v.new_zeros(batch, heads, d_k, d_v)
        outs = []  # chunks unbound once (see zoo.ops.delta_rule): no whole-sequence gradient per chunk
        for q_c, intra_c, decay, keys_c, v_c in zip(*(x.unbind(2) for x in (queries, intra, chunk_decay, state_keys,
                                                                             vc)), strict=True):
            outs.append(torch.matmul(q_c, state) + intra_c)
            state = decay * state + torch.matmul(keys_c.transpose(-1, -2), v_c)
        out = torch.stack(outs, dim=2).reshape(batch, heads, chunks * chunk, d_v)[:, :, :n]
    return out.to(out_dtype), state


def gated_linear_flops(n: int, d_k: int, d_v: int, per_channel: bool, chunk_size: int | None = None) -> float:
    """Forward FLOPs of :func:`gated_linear_attention` for one head."""
    c = min(chunk_size or (CHANNEL_CHUNK if per_channel else SCALAR_CHUNK), n)
    return 2.0 * n * c * (2 * d_k + d_v) + 2.0 * n * d_k * d_v * 2
