"""Decay parametrizations of gated recurrent layers (log α ≤ 0 per token): GLA's low-rank per-channel gate
(:class:`LowRankDecay`), Mamba2's per-head gate (:class:`Mamba2Decay`), RetNet's fixed per-head decays
(:func:`retnet_log_decay`) and Liger's gates pooled from the layer's own keys, without weights
(:func:`key_log_decay`). Plain modules the variants' learned weights hold as ``decay``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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


def key_log_decay(k: torch.Tensor, per_channel: bool, normalizer: float = 16.0) -> torch.Tensor:
    """Liger's gate (Lan et al. 2025) from the layer's keys, no weights: log α = logsigmoid(Pool(k)) / ``normalizer``.

    Pool is the identity per key channel (``per_channel``: k (B, H, n, d) -> log α (B, H, n, d), Liger's GLA) or the
    mean of each head's d channels (-> (B, H, n): one gate per head, Liger's average pooling down to one value per
    head). logsigmoid ≤ 0, so every log α ≤ 0 (α ∈ (0, 1]); in k's dtype."""
    pooled = k if per_channel else k.mean(-1)
    return F.logsigmoid(pooled) / normalizer
