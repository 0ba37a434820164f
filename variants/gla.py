"""``gla``: gated linear attention, a decaying unnormalized state (Yang et al. 2024), causal only.

    S_t = Diag(α_t) S_{t−1} + k_t v_tᵀ,    o_t = d_k^−½ · S_tᵀ q_t

``decay`` picks how α is made (one variant, three settings):

* ``"channel"`` (default, GLA): one α per key channel, log α = logsigmoid(W₂ W₁ x + b) / 16 with a rank-16
  projection of the layer's input hidden states (:class:`zoo.modules.LowRankDecay`,
  ``attention_zoo.decay.{down,up}``; fla's init);
* ``"scalar"``: one data-dependent α per head, Mamba2's α = exp(−exp(A_log)·softplus(W_a x + dt_bias)) -- the
  Mamba2 / SSD core (:class:`zoo.modules.Mamba2Decay`, Mamba2's init);
* ``"fixed"``: RetNet's per-head γ_h = 1 − 2^(−5−h), no learned gate.

``gates`` picks what the data-dependent decays read: ``"learned"`` (default) the gate weights above;
``"keys"`` Liger's gate (Lan et al. 2025), made from the layer's own keys with no weights, log α =
logsigmoid(Pool(k)) / 16 (:func:`zoo.modules.key_log_decay`): per channel (``"channel"``) each key channel's own
value, per head (``"scalar"``) the mean of the head's key channels. A retrofit then starts from gates the pretrained
key projection already makes. The keys are the ones this kernel receives: after the host's rotary embedding (Liger
pools the key projection's output before it; the zoo hands variants the rotated keys only), before the short
convolution. ``decay="fixed"`` has no gate to derive and refuses ``gates="keys"``.

q and k enter as the model gives them (fla's GLA has no feature map; with ``short_conv`` > 0 they are SiLU of their
convolution, as are the values); there is no denominator (as in GLA and RetNet): the output is scaled by d_k^−½,
then RMS-normalized per head with a learned gain (``output_norm``, default True: fla's ``g_norm``,
:class:`zoo.modules.OutputNorm`). The paper's output gate is left out. Learned gates read the attention module's
input hidden states (outside a model: the keys, heads merged). Padded tokens write nothing (k, v and the
convolution inputs zeroed, α = 1). Kernel: :func:`zoo.ops.gated_linear.gated_linear_attention` (chunkwise, every
exponent ≤ 0; bf16/fp16 on CUDA with ``attention-zoo[fla]``: fla's ``chunk_gla`` / ``chunk_simple_gla``,
:mod:`zoo.ops.backends.fla`); :meth:`reference` is the recurrence. The host's rotary embedding reaches q and k
before the kernel.

Decoding (:class:`zoo.cache.RecurrentLayer`): S (``gla``, (B, H, d_k, d_v) fp32) and the convolution inputs; O(d²)
per token, bytes independent of the context; no rollback (``crop`` and assisted decoding are refused).
"""

from __future__ import annotations

import torch
from torch import nn

from zoo.cache import RecurrentLayer
from zoo.modules import (
    LowRankDecay,
    Mamba2Decay,
    OutputNorm,
    ShortConv,
    gate_source,
    key_log_decay,
    normalized,
    retnet_log_decay,
)
from zoo.ops.backends.fla import model_dtype_inputs
from zoo.ops.gated_linear import gated_linear_attention, gated_linear_flops
from zoo.ops.gated_linear.naive import gated_linear_recurrence
from zoo.ops.state import carried, state_dtype
from zoo.variant import AttentionCall, LayerWeights, Param, Variant, VariantParameterError

STATE = "gla"


class GLAWeights(LayerWeights):
    """One layer's decay gate (none for ``decay="fixed"`` or ``gates="keys"``) and optional short convolutions."""

    needs_hidden_states = True

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        head_dim: int,
        decay: str,
        short_conv: int,
        output_norm: bool,
        gates: str = "learned",
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.needs_hidden_states = gates == "learned" and decay != "fixed"  # only learned gates read them
        if gates == "keys":
            self.decay = None
        elif decay == "channel":
            self.decay = LowRankDecay(hidden_size, heads, head_dim)
        elif decay == "scalar":
            self.decay = Mamba2Decay(hidden_size, heads)
        else:
            self.decay = None
        self.conv = ShortConv(heads, head_dim, short_conv) if short_conv else None
        self.norm = OutputNorm(head_dim) if output_norm else None


class GLAAttention(Variant):
    name = "gla"
    exact = False
    supports_bidirectional = False
    supports_dropout = False
    time_complexity = "O(n·C·d + n·d²)"
    memory_complexity = "O(n·C·d)"
    params = {
        "decay": Param(
            "channel",
            str,
            "'channel': per key channel (GLA); 'scalar': per head (Mamba2/SSD); 'fixed': RetNet's γ_h = 1 − 2^(−5−h)",
            choices=("channel", "scalar", "fixed"),
        ),
        "short_conv": Param(4, int, "taps of the causal depthwise convolution on q, k, v (0 = off)", min=0, max=64),
        "chunk_size": Param(None, int, "tokens per chunk (None: 16 per-channel, 64 per-head)", min=1, optional=True),
        "output_norm": Param(True, bool, "RMS-normalize each head's output, learned gain (fla's g_norm)"),
        "gates": Param(
            "learned",
            str,
            "'learned': gate weights read the hidden states; 'keys': Liger's gate from the "
            "layer's keys, log α = logsigmoid(k, or its mean per head for 'scalar') / 16, no gate weights",
            choices=("learned", "keys"),
        ),
    }
    error_bound = 1e-4  # relative error vs ``reference`` (the recurrence)
    test_params = {"chunk_size": 16}

    def check_config(self) -> None:
        if self.gates == "keys" and self.decay == "fixed":
            raise VariantParameterError(
                "attention-zoo variant 'gla': parameter 'gates' = 'keys' derives a data-dependent decay from the "
                "keys, but decay='fixed' (RetNet's γ_h) has none; use decay='channel' (Liger's GLA) or "
                "decay='scalar' with gates='keys', or keep gates='learned'."
            )

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> nn.Module | None:
        if not self.learns():
            return None
        return GLAWeights(
            config.hidden_size, num_heads, head_dim, self.decay, self.short_conv, self.output_norm, self.gates
        )

    def learns(self) -> bool:
        """False when no gate, convolution or norm has weights (RetNet's fixed decay, or gates from the keys)."""
        learned_gate = self.decay != "fixed" and self.gates == "learned"
        return learned_gate or bool(self.short_conv) or self.output_norm

    def cache_layer(self, layer_idx: int, config) -> RecurrentLayer:
        return RecurrentLayer()

    def prepare(self, q, k, v, call: AttentionCall, state: dict | None = None):
        """(q, k, v, log α) in the compute dtype, padded tokens zeroed (log α = 0 there)."""
        weights = self.layer_weights(call) if self.learns() else None
        dtype = state_dtype(q)
        mask = call.padding_mask
        with torch.autocast(device_type=q.device.type, enabled=False):
            if self.decay == "fixed":
                log_decay = retnet_log_decay(q.shape[1]).to(device=q.device, dtype=dtype)
                log_decay = log_decay[None, :, None].expand(q.shape[0], -1, k.shape[-2])
            elif self.gates == "keys":  # Liger: from the keys as they arrive, before the convolution
                log_decay = key_log_decay(k.to(dtype), per_channel=self.decay == "channel")
            else:
                source = gate_source(weights.hidden_states, k, weights.hidden_size, self.name).to(dtype)
                log_decay = weights.decay(source)  # the gates cast their weights to the source's dtype
            q, k, v = (x.to(dtype) for x in (q, k, v))
            if weights is not None and weights.conv is not None:
                q, k, v = weights.conv(q, k, v, mask, state)
            if mask is not None:
                real = mask[:, None, :]
                k, v = (x.masked_fill(~real[..., None], 0.0) for x in (k, v))
                log_decay = log_decay.masked_fill(~(real[..., None] if log_decay.dim() == 4 else real), 0.0)
        return q, k, v, log_decay

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        state = call.cache.state if isinstance(call.cache, RecurrentLayer) else None
        dtype = v.dtype
        q, k, v, log_decay = self.prepare(q, k, v, call, state)
        q, k, v = model_dtype_inputs(dtype, q, k, v)  # bf16/fp16 on CUDA with fla installed: fla's kernels
        out = carried(gated_linear_attention, state, STATE, q, k, v, log_decay, q.shape[-1] ** -0.5, self.chunk_size)
        return normalized(call.weights, out).to(dtype)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        dtype = v.dtype
        q, k, v, log_decay = self.prepare(q, k, v, call)
        out = gated_linear_recurrence(q, k, v, log_decay, q.shape[-1] ** -0.5)[0]
        return normalized(call.weights, out).to(dtype)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        return heads * gated_linear_flops(n, head_dim, head_dim, self.decay == "channel", self.chunk_size)
