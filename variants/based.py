"""``based``: linear attention with a 2nd-order Taylor feature map (Arora et al. 2024, "Simple linear attention
language models balance the recall-throughput tradeoff"), causal only.

Each head projects q and k to ``feature_dim`` (default 16) dimensions with a learned per-layer matrix
(``attention_zoo.feature_q`` / ``feature_k``, (heads, feature_dim, head_dim), Xavier-uniform per head), then

    φ(x) = [1, x / f^¼, x⊗x / (√2·√f)]  so that  φ(q)·φ(k) = 1 + s + s²/2,  s = q·k / √f,

the Taylor expansion of exp(s) (always ≥ ½, so the normalization never divides by 0). x⊗x keeps its upper
triangle only (off-diagonal pairs counted twice): 1 + f + f(f + 1)/2 features (153 at f = 16), the state size of the
paper. Normalized as the paper: o_t = φ(q_t)ᵀ Σ_{s≤t} φ(k_s) v_sᵀ / φ(q_t)ᵀ Σ_{s≤t} φ(k_s), through the chunked
prefix sums of :func:`zoo.ops.linear_attention`. ``short_conv`` (default 4; 0 = off) convolves q, k and v first
(:class:`zoo.modules.ShortConv`). The paper's sliding window is a separate layer: pair it with a
``longformer`` layer in a ``hybrid``. The host's rotary embedding reaches q and k before the projection.

Decoding (:class:`zoo.cache.RecurrentLayer`): Σφ(k)ᵀ[v, 1] per row and head (153·(d + 1) fp32 numbers at f = 16)
and the convolution inputs; O(f²·d) per token; no rollback.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from zoo.cache import RecurrentLayer
from zoo.modules import ShortConv
from zoo.ops import (
    allowed_mask,
    default_chunk_size,
    linear_attention,
    linear_attention_flops,
    linear_attention_reference,
)
from zoo.ops.state import state_dtype
from zoo.variant import AttentionCall, LayerWeights, Param, Variant


def taylor_features(x: torch.Tensor) -> torch.Tensor:
    """φ(x) (..., 1 + f + f(f + 1)/2) of x (..., f): φ(a)·φ(b) = 1 + s + s²/2 with s = a·b / √f."""
    f = x.shape[-1]
    rows, cols = torch.triu_indices(f, f, device=x.device)
    pairs = x[..., rows] * x[..., cols] / math.sqrt(f)
    pairs = torch.where(rows == cols, pairs / math.sqrt(2), pairs)  # x_i², counted once, gets 1/√2
    return torch.cat([torch.ones_like(x[..., :1]), x / f**0.25, pairs], dim=-1)


def taylor_feature_count(feature_dim: int) -> int:
    return 1 + feature_dim + feature_dim * (feature_dim + 1) // 2


class BasedWeights(LayerWeights):
    def __init__(self, heads: int, head_dim: int, feature_dim: int, short_conv: int) -> None:
        super().__init__()
        self.feature_q = nn.Parameter(torch.empty(heads, feature_dim, head_dim))
        self.feature_k = nn.Parameter(torch.empty(heads, feature_dim, head_dim))
        for matrix in (self.feature_q, self.feature_k):
            for head in matrix:
                nn.init.xavier_uniform_(head)
        self.conv = ShortConv(heads, head_dim, short_conv) if short_conv else None


class BasedAttention(Variant):
    name = "based"
    exact = False
    supports_bidirectional = False
    supports_dropout = False
    time_complexity = "O(n·f²·d)"
    memory_complexity = "O(n·f²)"
    params = {
        "feature_dim": Param(16, int, "dimensions q and k are projected to before the Taylor features", min=1,
                             max=64),
        "short_conv": Param(4, int, "taps of the causal depthwise convolution on q, k, v (0 = off)", min=0, max=64),
        "chunk_size": Param(None, int, "tokens per chunk of the prefix sums (None: chosen from the sizes)", min=1,
                            optional=True),
    }
    error_bound = 1e-4  # vs ``reference`` (its own kernel in O(n²))
    test_params = {"chunk_size": 16, "feature_dim": 8}

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> nn.Module:
        return BasedWeights(num_heads, head_dim, self.feature_dim, self.short_conv)

    def cache_layer(self, layer_idx: int, config) -> RecurrentLayer:
        return RecurrentLayer()

    def features(self, q, k, v, call: AttentionCall, state: dict | None = None):
        """(φ(q), φ(k), v) in the compute dtype, after the optional convolution."""
        weights = self.layer_weights(call)
        dtype = state_dtype(q)
        with torch.autocast(device_type=q.device.type, enabled=False):
            q, k, v = (x.to(dtype) for x in (q, k, v))
            if weights.conv is not None:
                q, k, v = weights.conv(q, k, v, call.padding_mask, state)
            q = torch.einsum("bhnd,hfd->bhnf", q, weights.feature_q.to(dtype))
            k = torch.einsum("bhnd,hfd->bhnf", k, weights.feature_k.to(dtype))
            return taylor_features(q), taylor_features(k), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        state = call.cache.state if isinstance(call.cache, RecurrentLayer) else None
        dtype = v.dtype
        phi_q, phi_k, v = self.features(q, k, v, call, state)
        out = linear_attention(phi_q, phi_k, v, True, call.padding_mask, self.chunk_for(q.shape[-1]), state=state)
        return out.to(dtype)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """The same attention in O(n²) (tests only)."""
        dtype = v.dtype
        batch, heads, q_len, _ = q.shape
        allowed = allowed_mask(call, None, batch, heads, q_len, k.shape[-2], q.device)
        phi_q, phi_k, v = self.features(q, k, v, call)
        return linear_attention_reference(phi_q, phi_k, v, allowed).to(dtype)

    def chunk_for(self, head_dim: int) -> int:
        return self.chunk_size or default_chunk_size(taylor_feature_count(self.feature_dim), head_dim)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        m = taylor_feature_count(self.feature_dim)
        projections = 2 * 2.0 * n * head_dim * self.feature_dim
        return heads * (projections + linear_attention_flops(n, m, head_dim, True, self.chunk_for(head_dim)))
