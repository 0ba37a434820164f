"""``deltanet``: linear attention with the delta rule (Schlag et al. 2021; Yang et al. 2024), causal only.

Per head a d_k x d_v state is corrected toward each new value instead of summed into:

    S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,    o_t = d_k^−½ · S_tᵀ q_t

* q, k: SiLU then L2 norm (per head; the SiLU is the short convolution's when ``short_conv`` > 0), so kkᵀ is a
  projection and β ∈ (0, 1) keeps every eigenvalue of I − β kkᵀ in [0, 1]. v: the layer's value (SiLU of its
  convolution when ``short_conv`` > 0). The output scale d_k^−½ is flash-linear-attention's default (the
  model's own softmax ``scaling`` is not used).
* β_t = sigmoid(W_β x_t), one per head, from the attention module's input hidden states x_t (a learned per-layer
  weight ``attention_zoo.beta.weight``, (heads, hidden), no bias, Xavier-uniform with gain 2^−2.5 as fla's layers:
  β ≈ 0.5 at the start). ``allow_negative_eigenvalues``: β = 2·sigmoid(·) ∈ (0, 2) (Grazzi et al. 2025), so
  I − β kkᵀ may reflect. Called outside a model (the contract suite) there are no hidden states and the gates
  read the keys with the heads merged (:func:`zoo.modules.gate_source`).
* ``short_conv`` (default 4, 0 = off): a learned causal depthwise convolution of that many taps on q, k and v
  (:class:`zoo.modules.ShortConv`, ``attention_zoo.conv.{q,k,v}.weight``).
* ``output_norm`` (default True): each head's output is RMS-normalized with a learned gain (d_v,), started at 1
  (:class:`zoo.modules.OutputNorm`, ``attention_zoo.norm.weight``; fla's ``o_norm``), which gives the
  readout a fixed scale; fla's output gate is left out (the host's output projection follows).
* Position encodings: the kernel receives q and k after the host model's rotary embedding (Llama), which then rotates
  the keys the state stores; GPT-2's absolute positions reach q/k through the hidden states instead.

Kernel: the chunkwise WY / UT form (:func:`zoo.ops.delta_rule.delta_rule`), O(n·C·d + n·d²) time, no n x n tensor,
fp32 states (bf16/fp16 on CUDA with ``attention-zoo[fla]``: fla's ``chunk_delta_rule`` /
``chunk_gated_delta_rule``, :mod:`zoo.ops.backends.fla`); :meth:`reference` is the token-by-token recurrence.
Padded tokens write nothing (β = 0, their k, v and convolution inputs zeroed). Without learned weights on disk (a
checkpoint saved before) they get the init above, seeded per layer, with one log line.

Decoding (:class:`zoo.cache.RecurrentLayer`): the state S (``delta``, (B, H, d_k, d_v) fp32) and the last
``short_conv − 1`` inputs of q, k and v (``conv_q``/``conv_k``/``conv_v``) per row: O(d²) per token and bytes
independent of the context. A state cannot be rolled back, so ``crop`` and assisted decoding are refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.cache import RecurrentLayer
from zoo.modules import OutputNorm, ShortConv, gate_source, normalized
from zoo.ops.backends.fla import model_dtype_inputs
from zoo.ops.delta_rule import DEFAULT_CHUNK, delta_rule, delta_rule_flops, l2_normalized
from zoo.ops.delta_rule.naive import delta_rule_recurrence
from zoo.ops.state import carried, state_dtype
from zoo.variant import AttentionCall, LayerWeights, Param, Variant

STATE = "delta"  # the cache's state-dict key of S


class DeltaNetWeights(LayerWeights):
    """One layer's β projection and (optional) short convolutions."""

    needs_hidden_states = True

    def __init__(self, hidden_size: int, heads: int, head_dim: int, short_conv: int, output_norm: bool) -> None:
        super().__init__()
        self.beta = nn.Linear(hidden_size, heads, bias=False)
        nn.init.xavier_uniform_(self.beta.weight, gain=2**-2.5)
        self.conv = ShortConv(heads, head_dim, short_conv) if short_conv else None
        self.norm = OutputNorm(head_dim) if output_norm else None


class DeltaNetAttention(Variant):
    name = "deltanet"
    exact = False  # not softmax attention: held to its own recurrence (``reference``)
    supports_bidirectional = False  # a recurrence over the past
    supports_dropout = False
    time_complexity = "O(n·C·d + n·d²)"
    memory_complexity = "O(n·(C + d))"
    params = {
        "short_conv": Param(4, int, "taps of the causal depthwise convolution on q, k, v (0 = off)", min=0, max=64),
        "allow_negative_eigenvalues": Param(False, bool, "β ∈ (0, 2) instead of (0, 1)"),
        "chunk_size": Param(DEFAULT_CHUNK, int, "tokens per chunk of the chunkwise kernel", min=1),
        "output_norm": Param(True, bool, "RMS-normalize each head's output, learned gain (fla's o_norm)"),
    }
    error_bound = 1e-4  # relative error vs ``reference`` (the recurrence), fp32 rounding
    test_params = {"chunk_size": 16}  # several chunks, the last one partial, at the contract suite's n = 100

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> nn.Module:
        return DeltaNetWeights(config.hidden_size, num_heads, head_dim, self.short_conv, self.output_norm)

    def cache_layer(self, layer_idx: int, config) -> RecurrentLayer:
        return RecurrentLayer()

    # ---------------------------------------------------------------------------------------------------

    def prepare(self, q, k, v, call: AttentionCall, state: dict | None = None):
        """(q, k, v, β, log α or None) as the kernel takes them, in the compute dtype; padded tokens zeroed."""
        weights = self.layer_weights(call)
        dtype = state_dtype(q)
        mask = call.padding_mask
        with torch.autocast(device_type=q.device.type, enabled=False):
            source = gate_source(weights.hidden_states, k, weights.beta.in_features, self.name).to(dtype)
            q, k, v = (x.to(dtype) for x in (q, k, v))
            keys = k  # as they arrive (after the host's rotary embedding), before the convolution and norms
            if weights.conv is not None:
                q, k, v = weights.conv(q, k, v, mask, state)
            else:
                q, k = F.silu(q), F.silu(k)
            q, k = l2_normalized(q), l2_normalized(k)
            beta = torch.sigmoid(F.linear(source, weights.beta.weight.to(dtype))).transpose(1, 2)  # (B, H, n)
            if self.allow_negative_eigenvalues:
                beta = 2 * beta
            log_decay = self.log_decay(weights, source, keys)
            if mask is not None:
                real = mask[:, None, :]
                beta = beta * real
                k, v = (x.masked_fill(~real[..., None], 0.0) for x in (k, v))
                if log_decay is not None:
                    log_decay = log_decay.masked_fill(~real, 0.0)
        return q, k, v, beta, log_decay

    def log_decay(self, weights: nn.Module, source: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        """log α (B, H, n) of each token from the gate source (B, n, hidden) or the layer's keys (B, H, n, d_k, before
        the convolution and norms); None: no decay (DeltaNet)."""
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        state = call.cache.state if isinstance(call.cache, RecurrentLayer) else None
        dtype = v.dtype
        q, k, v, beta, log_decay = self.prepare(q, k, v, call, state)
        q, k, v = model_dtype_inputs(dtype, q, k, v)  # bf16/fp16 on CUDA with fla installed: fla's kernels
        out = carried(delta_rule, state, STATE, q, k, v, beta, log_decay, q.shape[-1] ** -0.5, self.chunk_size)
        return normalized(call.weights, out).to(dtype)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """The recurrence, token by token (tests and the contract suite)."""
        dtype = v.dtype
        q, k, v, beta, log_decay = self.prepare(q, k, v, call)
        out = delta_rule_recurrence(q, k, v, beta, log_decay, q.shape[-1] ** -0.5)[0]
        return normalized(call.weights, out).to(dtype)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        return heads * delta_rule_flops(n, head_dim, head_dim, self.chunk_size)
