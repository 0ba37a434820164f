"""``linear``: the Linear Transformer (Katharopoulos et al. 2020), attention with the kernel φ(q)·φ(k),
φ(x) = elu(x) + 1, in O(n·d²) through :func:`zoo.ops.linear_attention` (causal: chunked prefix sums).

It is not an approximation of softmax attention but a different attention, so it declares ``exact = False``
(``zoo list``: approximate) and a :meth:`LinearAttention.reference`: its own kernel in O(n²),
out_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j) over the keys j allowed by causality and padding, which the
contract suite uses instead of softmax; ``error_bound`` is the relative error allowed against it (fp32 rounding).
The softmax ``scaling`` is not used (φ has no temperature), as in the paper.

Decoding (:class:`zoo.cache.RecurrentLayer`, the RNN view of the paper): the cache keeps no keys, only
S = Σφ(k)ᵀ[v, 1] per batch row and head (h·d·(d + 1) fp32 numbers per layer, whatever the context length);
prefill builds it in the same chunked O(n) pass, each new token costs O(d²). It cannot be rolled back
(assisted decoding is refused with a clear error).

``short_conv`` (default 0 = off, as saved models and the main job were trained): a learned causal depthwise
convolution of that many taps on q, k and v before φ (:class:`zoo.modules.ShortConv`, weights
``attention_zoo.{q,k,v}.weight``; its last inputs join the decoding state).

``feature_map: hedgehog`` (Hedgehog, Zhang et al. 2024, arXiv 2402.04347; the feature map of LoLCATs' stage 1):
a learned map per layer and head, one for q and one for k,

    φ(x) = [softmax(W x + b) ⊕ softmax(−(W x + b))]  over the ``feature_dim`` features,

W (heads, feature_dim, head_dim) and b (heads, feature_dim) (``attention_zoo.feature_q`` / ``bias_q``,
``feature_k`` / ``bias_k``), applied to q and k as the host hands them over (after its rotary embedding), no softmax
scaling. φ(q)·φ(k) is positive, bounded by 2 and spiky where softmax's exp(q·k) is: trained by the cross-entropy of
its attention weights (:meth:`LinearAttention.attention_weights`) against softmax's (a retrofit's
``transfer.loss: attention``), it learns to place its mass where softmax attention does. 2·feature_dim features
(``feature_dim`` None = head_dim): the state holds h·2f·(d + 1) numbers. W starts at the identity (eye of
feature_dim x head_dim) and b at 0, so an untrained map is softmax(x) ⊕ softmax(−x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.cache import RecurrentLayer
from zoo.modules import ShortConv
from zoo.ops import (
    allowed_mask,
    default_chunk_size,
    in_head_groups,
    linear_attention,
    linear_attention_flops,
    linear_attention_reference,
)
from zoo.ops.state import autocast_off, state_dtype
from zoo.variant import AttentionCall, LayerWeights, Param, Variant, VariantParameterError

FEATURE_MAPS = ("elu", "hedgehog")


def elu_features(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1: positive, smooth, the paper's feature map (computed in fp32 for low-precision inputs)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.elu(x.to(state_dtype(x))) + 1.0


def hedgehog_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """φ(x) = [softmax(Wx + b) ⊕ softmax(−(Wx + b))] of x (B, H, n, d) per head: weight (H, f, d), bias (H, f);
    returns (B, H, n, 2f), each half summing to 1."""
    z = torch.matmul(x, weight.transpose(-1, -2)) + bias[:, None, :]  # one batched product (einsum costs 4x a step)
    return torch.stack([z, -z], dim=-2).softmax(dim=-1).flatten(-2)  # both halves in one softmax call


class HedgehogWeights(LayerWeights):
    """One layer's Hedgehog maps, q's and k's (W at the identity, b at 0), and its :class:`ShortConv` when on."""

    def __init__(self, heads: int, head_dim: int, feature_dim: int, short_conv: int) -> None:
        super().__init__()
        identity = torch.eye(feature_dim, head_dim).expand(heads, feature_dim, head_dim)
        self.feature_q = nn.Parameter(identity.clone())
        self.feature_k = nn.Parameter(identity.clone())
        self.bias_q = nn.Parameter(torch.zeros(heads, feature_dim))
        self.bias_k = nn.Parameter(torch.zeros(heads, feature_dim))
        self.conv = ShortConv(heads, head_dim, short_conv) if short_conv else None


class LinearAttention(Variant):
    name = "linear"
    exact = False  # not softmax attention: held to its own kernel (``reference``), not to softmax
    supports_dropout = False
    time_complexity = "O(n·d²)"
    memory_complexity = "O(n·d)"
    params = {
        "chunk_size": Param(
            None, int, "causal only: tokens per chunk of the prefix sums (None = chosen from head_dim)",
            min=1, optional=True,
        ),
        "short_conv": Param(0, int, "taps of a learned causal depthwise convolution on q, k, v (0 = off)", min=0,
                            max=64),
        "feature_map": Param("elu", str, "elu: elu(x) + 1; hedgehog: learned [softmax(Wx+b) ⊕ softmax(−Wx−b)]",
                             choices=FEATURE_MAPS),
        "feature_dim": Param(None, int, "hedgehog only: features per half (None = head_dim); 2x as many in all",
                             min=1, max=1024, optional=True),
    }
    error_bound = 1e-5  # relative error vs ``reference`` (its own kernel), not vs softmax
    test_params = {"chunk_size": 16}  # several chunks at the contract suite's n = 64-200

    def check_config(self) -> None:
        if self.feature_dim is not None and self.feature_map != "hedgehog":
            raise VariantParameterError(
                f"attention-zoo variant 'linear': feature_dim={self.feature_dim} sizes the learned 'hedgehog' feature "
                f"map; feature_map={self.feature_map!r} uses q and k as they are. Drop feature_dim, or set "
                "feature_map='hedgehog'."
            )

    def cache_layer(self, layer_idx: int, config) -> RecurrentLayer:
        """Decoding keeps no keys: the running sums Σφ(k)ᵀv and Σφ(k) per batch row and head (fp32), built by
        the prefill in one O(n) pass and advanced in O(d²) per token."""
        return RecurrentLayer()

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> nn.Module | None:
        if self.feature_map == "hedgehog":
            return HedgehogWeights(num_heads, head_dim, self.feature_dim or head_dim, self.short_conv)
        # elu: the convolution alone (or nothing), so its weights stay ``attention_zoo.{q,k,v}.weight``
        return ShortConv(num_heads, head_dim, self.short_conv) if self.short_conv else None

    def features(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall,
                 state: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(φ(q), φ(k), v) in the compute dtype (fp32 for bf16/fp16 inputs, fp64 for fp64), after the optional
        short convolution, which continues from ``state`` (a :class:`RecurrentLayer`'s state dict) when given.
        Padded tokens are not zeroed here: :func:`zoo.ops.linear_attention` masks them (or the caller does)."""
        q, k, v = self._convolved(q, k, v, call, state)
        return self._mapped(q, k, v, call)

    def _convolved(self, q, k, v, call: AttentionCall, state: dict | None) -> tuple:
        """q, k, v through the layer's :class:`ShortConv` in their own dtype (its kept inputs too); unchanged without
        one."""
        weights = call.weights
        conv = weights if isinstance(weights, ShortConv) else getattr(weights, "conv", None)
        if conv is None:
            if self.short_conv:
                self.layer_weights(call)  # the clear error: the module was built without its weights
            return q, k, v
        return conv(q, k, v, call.padding_mask, state)

    def _mapped(self, q, k, v, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """φ(q), φ(k) and v in the compute dtype (no convolution)."""
        dtype = state_dtype(q)
        with autocast_off(q.device.type):
            q, k, v = (x.to(dtype) for x in (q, k, v))
            if self.feature_map == "elu":
                return F.elu(q) + 1.0, F.elu(k) + 1.0, v
            weights = self.layer_weights(call)
            phi_q = hedgehog_features(q, weights.feature_q.to(dtype), weights.bias_q.to(dtype))
            phi_k = hedgehog_features(k, weights.feature_k.to(dtype), weights.bias_k.to(dtype))
            return phi_q, phi_k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        dtype, chunk = v.dtype, self.chunk_for(q.shape[-1])
        if isinstance(call.cache, RecurrentLayer):  # k/v: the new tokens; the earlier ones are in the state
            state = call.cache.state
            phi_q, phi_k, v = self.features(q, k, v, call, state)
            return linear_attention(phi_q, phi_k, v, True, call.padding_mask, chunk, state=state).to(dtype)
        if self.feature_map == "hedgehog":
            phi_q, phi_k, v = self.features(q, k, v, call)
            return linear_attention(phi_q, phi_k, v, call.causal, call.padding_mask, chunk).to(dtype)
        # elu: the element-wise map runs per cache-sized group of heads, fused with the sums (zoo.ops.in_head_groups)
        q, k, v = self._convolved(q, k, v, call, None)

        def heads(q, k, v):
            return linear_attention(*self._mapped(q, k, v, call), call.causal, call.padding_mask, chunk)

        return in_head_groups(heads, q, k, v).to(dtype)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """The same attention in O(n²), in fp64: the dense φ(q)φ(k)ᵀ under causality and padding (tests only)."""
        batch, heads, q_len, _ = q.shape
        allowed = allowed_mask(call, None, batch, heads, q_len, k.shape[-2], q.device)
        phi_q, phi_k, v64 = self.features(*(x.to(torch.float64) for x in (q, k, v)), call)
        return linear_attention_reference(phi_q, phi_k, v64, allowed).to(v.dtype)

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """The dense (B, H, Nq, N) distribution of each query over the keys it may see (causality and padding):
        φ(q_i)·φ(k_j) / Σ_j' φ(q_i)·φ(k_j'), in the compute dtype; a query with no key gets a zero row. Multiplied
        by v it is :meth:`reference`. O(n²): training losses on short sequences (a retrofit's
        ``transfer.loss: attention``) and tests only."""
        phi_q, phi_k, _ = self.features(q, k, k, call)  # v is not read: k stands in for the convolution
        scores = torch.matmul(phi_q, phi_k.transpose(-1, -2))
        allowed = allowed_mask(call, None, q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], q.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, 0.0)
        return scores / scores.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)

    def feature_count(self, head_dim: int) -> int:
        """Features per query and key: head_dim for elu, 2·feature_dim for hedgehog."""
        return head_dim if self.feature_map == "elu" else 2 * (self.feature_dim or head_dim)

    def chunk_for(self, head_dim: int) -> int:
        return self.chunk_size or default_chunk_size(self.feature_count(head_dim), head_dim)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        m = self.feature_count(head_dim)
        maps = 0.0 if self.feature_map == "elu" else 2 * 2.0 * n * head_dim * (self.feature_dim or head_dim)
        return heads * (maps + linear_attention_flops(n, m, head_dim, causal, self.chunk_for(head_dim)))
