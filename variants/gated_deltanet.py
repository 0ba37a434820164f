"""``gated_deltanet``: the delta rule with a data-dependent decay per head (Yang et al. 2025), causal only.

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,    o_t = d_k^−½ · S_tᵀ q_t,
    α_t = exp(−exp(A_log) · softplus(W_a x_t + dt_bias))

Everything else is ``deltanet``'s (q, k SiLU + L2 norm, β = sigmoid(W_β x), ``short_conv``, ``output_norm``,
padding, decoding, position encodings; see :mod:`zoo.variants.deltanet`). The decay is Mamba2's parametrization and
init (:class:`zoo.modules.Mamba2Decay`: ``attention_zoo.decay.{proj.weight, A_log, dt_bias}``); padded
tokens get α = 1. ``gates="keys"``: Liger's gate (Lan et al. 2025) instead, made from the layer's own keys with no
weights, log α_t = logsigmoid(mean of the head's key channels) / 16 (:func:`zoo.modules.key_log_decay`; the keys as
the kernel receives them: after the host's rotary embedding, before the convolution, SiLU and L2 norm), so a
retrofit starts from gates the pretrained key projection makes; no ``attention_zoo.decay`` weights then.
The paper's output gate is left out (the host model's output projection follows the kernel).
Kernel: the gated chunkwise UT form (:func:`zoo.ops.delta_rule.delta_rule` with ``log_decay``).
"""

from __future__ import annotations

import torch
from torch import nn
from zoo.variants.deltanet import DeltaNetAttention, DeltaNetWeights

from zoo.modules import Mamba2Decay, key_log_decay
from zoo.variant import Param


class GatedDeltaNetWeights(DeltaNetWeights):
    def __init__(
        self, hidden_size: int, heads: int, head_dim: int, short_conv: int, output_norm: bool, gates: str = "learned"
    ) -> None:
        super().__init__(hidden_size, heads, head_dim, short_conv, output_norm)
        self.decay = Mamba2Decay(hidden_size, heads) if gates == "learned" else None


class GatedDeltaNetAttention(DeltaNetAttention):
    name = "gated_deltanet"
    params = {
        **DeltaNetAttention.params,
        "gates": Param(
            "learned",
            str,
            "'learned': Mamba2's decay gate from the hidden states; 'keys': Liger's gate "
            "from the layer's keys, log α = logsigmoid(mean of the head's keys) / 16, no decay weights",
            choices=("learned", "keys"),
        ),
    }

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> nn.Module:
        return GatedDeltaNetWeights(
            config.hidden_size, num_heads, head_dim, self.short_conv, self.output_norm, self.gates
        )

    def log_decay(self, weights: nn.Module, source: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        if self.gates == "keys":
            return key_log_decay(keys, per_channel=False)
        return weights.decay(source)
