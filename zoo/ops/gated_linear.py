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

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo.ops.delta_rule import state_dtype
from zoo.ops.fla_backend import fla_gated_linear, fla_kernel

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
    (:mod:`zoo.ops.fla_backend`)."""
    per_channel = log_decay.dim() == 4
    if (kernel := fla_kernel("gla" if per_channel else "simple_gla", q, k, v)) is not None:
        return fla_gated_linear(kernel, q, k, v, log_decay, scale, initial_state)
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


def gated_linear_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, token by token (the ``gla`` variant's ``reference`` and the tests); same arguments and
    results as :func:`gated_linear_attention`."""
    dtype, out_dtype = state_dtype(v), v.dtype
    with torch.autocast(device_type=v.device.type, enabled=False):
        q, k, v, g = (x.to(dtype) for x in (q, k, v, log_decay))
        batch, heads, n, d_k = k.shape
        state = initial_state.to(dtype) if initial_state is not None else v.new_zeros(batch, heads, d_k, v.shape[-1])
        outs = []
        for t in range(n):
            alpha = g[:, :, t].exp()
            alpha = alpha[..., :, None] if g.dim() == 4 else alpha[..., None, None]
            state = alpha * state + k[:, :, t, :, None] * v[:, :, t, None, :]
            outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
        out = torch.stack(outs, dim=2) if outs else v.new_zeros(batch, heads, 0, v.shape[-1])
    return out.to(out_dtype), state


def gated_linear_flops(n: int, d_k: int, d_v: int, per_channel: bool, chunk_size: int | None = None) -> float:
    """Forward FLOPs of :func:`gated_linear_attention` for one head."""
    c = min(chunk_size or (CHANNEL_CHUNK if per_channel else SCALAR_CHUNK), n)
    return 2.0 * n * c * (2 * d_k + d_v) + 2.0 * n * d_k * d_v * 2


# ---------------------------------------------------------------------------------------------------------
# learned decay gates (plain modules: the variants' weights hold them)


class LowRankDecay(nn.Module):
    """GLA's forget gate per key channel: log α = logsigmoid(W₂ W₁ x + b) / ``normalizer`` with a rank-``rank``
    projection (hidden -> rank -> heads·d_k); the weights start Xavier-uniform with gain 2^−2.5 and the bias at 0,
    as flash-linear-attention's GLA layer initializes them (log α ≈ −0.043 per token at the start)."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, rank: int = 16, normalizer: float = 16.0) -> None:
        super().__init__()
        self.heads, self.head_dim, self.normalizer = heads, head_dim, normalizer
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, heads * head_dim, bias=True)
        for layer in (self.down, self.up):
            nn.init.xavier_uniform_(layer.weight, gain=2**-2.5)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, n, hidden) -> log α (B, H, n, d_k), in x's dtype."""
        gate = F.linear(F.linear(x, self.down.weight.to(x.dtype)), self.up.weight.to(x.dtype), self.up.bias.to(x.dtype))
        gate = F.logsigmoid(gate) / self.normalizer
        return gate.unflatten(-1, (self.heads, self.head_dim)).permute(0, 2, 1, 3)


class Mamba2Decay(nn.Module):
    """One data-dependent decay per head, Mamba2's parametrization: log α = −exp(A_log) · softplus(W_a x + dt_bias).
    Init as Mamba2: A ~ U(1, 16) (A_log = log A); dt = exp(U(log 0.001, log 0.1)) floored at 1e-4 and dt_bias its
    inverse softplus, so softplus(dt_bias) = dt at the start; W_a Xavier-uniform with gain 2^−2.5 (fla's layers)."""

    def __init__(self, hidden_size: int, heads: int, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, heads, bias=False)
        nn.init.xavier_uniform_(self.proj.weight, gain=2**-2.5)
        self.A_log = nn.Parameter(torch.empty(heads).uniform_(1, 16).log())
        dt = torch.exp(torch.rand(heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, n, hidden) -> log α (B, H, n), in x's dtype."""
        dt = F.softplus(F.linear(x, self.proj.weight.to(x.dtype)) + self.dt_bias.to(x.dtype))
        return (-self.A_log.to(x.dtype).exp() * dt).transpose(1, 2)


def retnet_log_decay(heads: int) -> torch.Tensor:
    """RetNet's fixed per-head decays, log γ_h with γ_h = 1 − 2^(−5−h) (h = 0 .. heads − 1), fp64."""
    return torch.log1p(-(2.0 ** (-5.0 - torch.arange(heads, dtype=torch.float64))))


class OutputNorm(nn.Module):
    """RMS norm of each head's output with a learned gain (d_v,) shared by the heads, started at 1 (eps 1e-5): the
    ``o_norm`` flash-linear-attention's recurrent layers apply before the output projection. An unnormalized state's
    readout has no fixed scale (d_k^−½ · Sᵀq is a few times smaller than softmax attention's value average at the
    start); the norm gives it one."""

    def __init__(self, head_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        """out (B, H, n, d_v) -> the same shape and dtype, normalized in fp32 (fp64 for fp64)."""
        x = out.to(state_dtype(out))
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight.to(x.dtype)
        return x.to(out.dtype)


def normalized(weights: nn.Module | None, out: torch.Tensor) -> torch.Tensor:
    """``out`` through the layer weights' :class:`OutputNorm` (``weights.norm``) when they have one."""
    norm = getattr(weights, "norm", None)
    return norm(out) if norm is not None else out
