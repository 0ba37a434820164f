"""The learned short convolution of q, k and v (:class:`ShortConv`, fla's ``ShortConvolution``) over
:func:`zoo.ops.causal_conv.causal_conv`, and the call-side helper that runs it (:func:`short_conv_inputs`).

One module for every recurrent-state variant (``deltanet``, ``gated_deltanet``, ``gla``, ``based``, ``linear``,
``performer``): a plain ``nn.Module`` the variants' learned weights hold as ``conv``. Decoding: the last
``kernel_size − 1`` inputs (after zeroing padding) of q, k and v live in the recurrent cache's state dict
(``conv_q``, ``conv_k``, ``conv_v``, (B, H·d, K − 1)), so a new token convolves over them.
"""

from __future__ import annotations

import torch
from torch import nn

from zoo.call import AttentionCall
from zoo.ops.causal_conv import causal_conv

STATE_KEYS = ("conv_q", "conv_k", "conv_v")


class ShortConv(nn.Module):
    """Depthwise causal convolutions for q, k and v of ``heads`` x ``head_dim`` channels each (``q``, ``k``, ``v``:
    ``nn.Conv1d`` without bias, PyTorch's default init U(−1/√K, 1/√K), as fla's ``ShortConvolution`` gets)."""

    def __init__(self, heads: int, head_dim: int, kernel_size: int, value_dim: int | None = None) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        dims = (head_dim, head_dim, value_dim or head_dim)
        self.q, self.k, self.v = (
            nn.Conv1d(heads * d, heads * d, kernel_size, groups=heads * d, bias=False) for d in dims
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None = None,
                state: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SiLU(conv(·)) of q, k, v (B, H, n, d); with ``state`` (a recurrent cache's dict) it continues from the
        inputs kept there and replaces them with the last K − 1 of these."""
        outs = []
        for x, conv, key in zip((q, k, v), (self.q, self.k, self.v), STATE_KEYS, strict=True):
            out, last = causal_conv(x, conv.weight, padding_mask, None if state is None else state.get(key))
            if state is not None:
                state[key] = last
            outs.append(out)
        return tuple(outs)


def short_conv_inputs(variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> tuple:
    """q, k, v through the layer's :class:`ShortConv` (``call.weights``, or its ``conv`` when the layer's module holds
    more, as performer's redraw counter does) when ``short_conv`` > 0, continuing from a recurrent cache's state;
    unchanged otherwise."""
    conv = call.weights if isinstance(call.weights, ShortConv) else getattr(call.weights, "conv", None)
    if not isinstance(conv, ShortConv):
        if getattr(variant, "short_conv", 0):
            variant.layer_weights(call)  # the clear error: the module was built without its weights
        return q, k, v
    state = getattr(call.cache, "state", None) if call.cache is not None else None
    return conv(q, k, v, call.padding_mask, state if isinstance(state, dict) else None)
