"""Thin wrappers over torch's CPU flash-attention kernels (forward returning the log-sum-exp, and backward).

``scaled_dot_product_attention`` runs these for 4-D CPU inputs but hides the log-sum-exp; kernels that merge
several softmax parts (:mod:`zoo.ops.union`) or recompute chunks in the backward (:mod:`zoo.ops.gathered`) call
them directly. A query whose keys are all masked gets a zero output, log-sum-exp 0 and zero gradients.
"""

from __future__ import annotations

import torch

FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flash_available(x: torch.Tensor) -> bool:
    """Whether the CPU chunked kernels apply: CPU tensors of a supported dtype (with dropout, they run
    :mod:`zoo.ops.dropout`'s counterparts of the flash kernels)."""
    return x.device.type == "cpu" and x.dtype in FLASH_DTYPES


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``allowed`` -> 0 where allowed, -inf elsewhere (the flash kernels take additive masks)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def flash_forward(q, k, v, mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, Q, D) queries over (B, H, K, D) keys -> (output (B, H, Q, D), log-sum-exp (B, H, Q))."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )
    return out, lse


def flash_backward(grad, q, k, v, out, lse, mask: torch.Tensor | None, scale: float):
    """Gradients (q, k, v) of :func:`flash_forward` given its ``out`` and ``lse`` (which may be merged ones)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale
    )
