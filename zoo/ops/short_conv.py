"""Short causal depthwise convolutions on q, k and v (the "shift" of H3 / Based / DeltaNet; flash-linear-attention's
``ShortConvolution``, written here from its definition): every channel of every head gets its own kernel of
``kernel_size`` taps over the current and previous tokens, then SiLU,

    x'_t = SiLU(Σ_{j < K} w_j ⊙ x_{t−j}).

It lets a recurrent layer bind a key to the token before it at no state cost. One module for every recurrent-state
variant (``deltanet``, ``gated_deltanet``, ``gla``, ``based``, ``linear``, ``performer``): :class:`ShortConv`, a
plain ``nn.Module`` the variants' learned weights hold as ``conv``.

Padding: inputs at padded positions are zeroed before the convolution, so a left-padded row convolves exactly as
the same row unpadded (the taps before its first token see zeros), and right padding never reaches a real token
(causal). Decoding: the last ``kernel_size − 1`` inputs (after zeroing) of q, k and v live in the recurrent
cache's state dict (``conv_q``, ``conv_k``, ``conv_v``, (B, H·d, K − 1)), so a new token convolves over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

STATE_KEYS = ("conv_q", "conv_k", "conv_v")


class _ShiftedSum(torch.autograd.Function):
    """out_t = Σ_j w_j ⊙ x_{t−(K−1−j)} over the K taps of x (B, H, m, d), zeros before x's first token, w (H, 1, d, K):
    fused multiply-adds over shifted views forward and backward, nothing padded or zero-filled at full size (autograd
    would add a full-size gradient per tap, and a padded copy costs two passes over x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        taps, m = w.shape[-1], x.shape[2]
        out = x * w[..., taps - 1]
        for j in range(taps - 1):
            shift = taps - 1 - j
            if shift < m:
                out[:, :, shift:].addcmul_(x[:, :, :m - shift], w[..., j])
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        taps, m = w.shape[-1], x.shape[2]
        d_x = d_w = None
        if ctx.needs_input_grad[0]:  # ∂x_s = Σ_j w_j ⊙ grad_{s+K−1−j}
            d_x = grad * w[..., taps - 1]
            for j in range(taps - 1):
                shift = taps - 1 - j
                if shift < m:
                    d_x[:, :, :m - shift].addcmul_(grad[:, :, shift:], w[..., j])
        if ctx.needs_input_grad[1]:
            d_w = torch.stack([
                (grad[:, :, taps - 1 - j:] * x[:, :, :m - (taps - 1 - j)]).sum((0, 2)) for j in range(taps)
            ], dim=-1)[:, None]
        return d_x, d_w


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, padding_mask: torch.Tensor | None = None,
    previous: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, n, d); weight (H·d, 1, K) (a depthwise ``nn.Conv1d``'s); padding_mask (B, n) bool, True = real;
    ``previous`` (B, H·d, K − 1): the inputs before x (None: zeros). Returns (SiLU(conv(x)) (B, H, n, d), the last
    K − 1 inputs (B, H·d, K − 1), for the next call)."""
    batch, heads, n, dim = x.shape
    taps = weight.shape[-1]
    if padding_mask is not None:
        x = x.masked_fill(~padding_mask[:, None, :, None], 0.0)
    # the sum of ``taps`` shifted products over (B, H, n, d): the output comes out contiguous in the layout the
    # kernels read, with no transposed copies (a depthwise conv1d wants (B, H·d, n)); kept inputs go before x
    w = weight.to(x.dtype).view(heads, 1, dim, taps)
    if previous is None:
        out = _ShiftedSum.apply(x, w)
        inputs = x if n >= taps - 1 else F.pad(x, (0, 0, taps - 1 - n, 0))
    else:
        before = previous.to(x.dtype).reshape(batch, heads, dim, taps - 1).transpose(-1, -2)
        inputs = torch.cat([before, x], dim=2)
        out = _ShiftedSum.apply(inputs, w)[:, :, taps - 1:]
    last = inputs[:, :, inputs.shape[2] - (taps - 1):].transpose(-1, -2).reshape(batch, heads * dim, taps - 1)
    return F.silu(out), last


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


def gate_source(hidden_states: torch.Tensor | None, k: torch.Tensor, width: int, variant: str) -> torch.Tensor:
    """What a token's gates (β, α) are projected from: the attention module's input hidden states (B, n, hidden)
    inside a model; a kernel called alone (the contract suite) has none and uses its keys with the heads merged
    (B, n, H·d), which must then have the projection's ``width``."""
    if hidden_states is not None:
        if hidden_states.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"attention-zoo variant {variant!r}: the layer's hidden states cover {hidden_states.shape[-2]} tokens "
                f"but the keys {k.shape[-2]}; the gates need one hidden state per key."
            )
        return hidden_states
    merged = k.transpose(1, 2).flatten(2)
    if merged.shape[-1] != width:
        raise ValueError(
            f"attention-zoo variant {variant!r} projects its gates from the layer's hidden states, which the zoo hands "
            "over only inside a model; called alone, the keys (heads merged) stand in, and they have "
            f"{merged.shape[-1]} channels where the projection takes {width}."
        )
    return merged


def short_conv_inputs(variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call) -> tuple:
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
