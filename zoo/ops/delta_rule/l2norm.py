"""L2 normalization of q and k over the head dim with a fused backward (the delta rule's keys must have unit norm)."""

from __future__ import annotations

import torch


class _L2Normalize(torch.autograd.Function):
    """x / max(‖x‖, eps) over the last dim (``F.normalize``'s forward, bit for bit) with a fused backward:
    ∂x = (g − z ⟨z, g⟩) / max(‖x‖, eps), the projection term dropped where the norm is clamped at eps."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        denominator = norm.clamp_min(eps)
        z = x / denominator
        ctx.save_for_backward(z, denominator, norm > eps)
        return z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        z, denominator, unclamped = ctx.saved_tensors
        along = torch.linalg.vecdot(z, grad, dim=-1).unsqueeze(-1) * unclamped
        return torch.addcmul(grad, z, along, value=-1) / denominator, None


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``F.normalize(x, dim=-1, eps=eps)`` with a backward of four passes over x instead of autograd's nine."""
    return _L2Normalize.apply(x, eps)
