"""Short causal depthwise convolution (the "shift" of H3 / Based / DeltaNet; flash-linear-attention's
``ShortConvolution``, written here from its definition): every channel of every head gets its own kernel of
``kernel_size`` taps over the current and previous tokens, then SiLU,

    x'_t = SiLU(Σ_{j < K} w_j ⊙ x_{t−j}).

Plain tensors in and out (:func:`causal_conv`); the learned module the variants hold is
:class:`zoo.modules.ShortConv`. Inputs at padded positions are zeroed before the convolution, so a left-padded row
convolves exactly as the same row unpadded, and right padding never reaches a real token (causal); ``previous``
carries the last ``kernel_size − 1`` inputs across decoding steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
