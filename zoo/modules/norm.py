"""The per-head output norm of recurrent layers (:class:`OutputNorm`, fla's ``o_norm`` / ``g_norm``)."""

from __future__ import annotations

import torch
from torch import nn

from zoo.ops.state import state_dtype


class OutputNorm(nn.Module):
    """RMS norm of each head's output with a learned gain (d_v,) shared by the heads, started at 1 (eps 1e-5): the
    ``o_norm`` flash-linear-attention's recurrent layers apply before the output projection. An unnormalized state's
    readout has no fixed scale (d_k^−½ · Sᵀq is a few times smaller than softmax attention's value average at the
    start); the norm gives it one."""

    def __init__(self, head_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        """out (B, H, n, d_v) -> the same shape and dtype, normalized in fp32 (fp64 for fp64)."""
        x = out.to(state_dtype(out))
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight.to(x.dtype)
        return x.to(out.dtype)


def normalized(weights: nn.Module | None, out: torch.Tensor) -> torch.Tensor:
    """``out`` through the layer weights' :class:`OutputNorm` (``weights.norm``) when they have one."""
    norm = getattr(weights, "norm", None)
    return norm(out) if norm is not None else out
