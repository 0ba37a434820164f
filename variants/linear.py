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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.cache import RecurrentLayer
from zoo.modules import ShortConv, short_conv_inputs
from zoo.ops import (
    allowed_mask,
    default_chunk_size,
    in_head_groups,
    linear_attention,
    linear_attention_flops,
    linear_attention_reference,
)
from zoo.variant import AttentionCall, Param, Variant


def elu_features(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1: positive, smooth, the paper's feature map (computed in fp32 for low-precision inputs)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.elu(x.to(compute)) + 1.0


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
    }
    error_bound = 1e-5  # relative error vs ``reference`` (its own kernel), not vs softmax
    test_params = {"chunk_size": 16}  # several chunks at the contract suite's n = 64-200

    def cache_layer(self, layer_idx: int, config) -> RecurrentLayer:
        """Decoding keeps no keys: the running sums Σφ(k)ᵀv and Σφ(k) per batch row and head (fp32), built by
        the prefill in one O(n) pass and advanced in O(d²) per token."""
        return RecurrentLayer()

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> ShortConv | None:
        return ShortConv(num_heads, head_dim, self.short_conv) if self.short_conv else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        q, k, v = short_conv_inputs(self, q, k, v, call)
        if isinstance(call.cache, RecurrentLayer):  # k/v: the new tokens; the earlier ones are in the state
            return linear_attention(elu_features(q), elu_features(k), v, True, call.padding_mask,
                                    self.chunk_for(q.shape[-1]), state=call.cache.state)

        def heads(q, k, v):
            chunk = self.chunk_for(q.shape[-1])
            return linear_attention(elu_features(q), elu_features(k), v, call.causal, call.padding_mask, chunk)

        return in_head_groups(heads, q, k, v)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """The same attention in O(n²): the dense φ(q)φ(k)ᵀ under causality and padding (tests only)."""
        q, k, v = short_conv_inputs(self, q, k, v, call)
        batch, heads, q_len, _ = q.shape
        allowed = allowed_mask(call, None, batch, heads, q_len, k.shape[-2], q.device)
        q, k, v64 = (x.to(torch.float64) for x in (q, k, v))
        return linear_attention_reference(elu_features(q), elu_features(k), v64, allowed).to(v.dtype)

    def chunk_for(self, head_dim: int) -> int:
        return self.chunk_size or default_chunk_size(head_dim, head_dim)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        return heads * linear_attention_flops(n, head_dim, head_dim, causal, self.chunk_for(head_dim))
