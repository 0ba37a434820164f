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


def flash_forward(q, k, v, mask: torch.Tensor | None, scale: float,
                  causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, Q, D) queries over (B, H, K, D) keys -> (output (B, H, Q, D), log-sum-exp (B, H, Q)); ``causal``:
    query i reads keys 0 .. i (the kernel skips the tiles above the diagonal)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )
    return out, lse


def flash_backward(grad, q, k, v, out, lse, mask: torch.Tensor | None, scale: float, causal: bool = False):
    """Gradients (q, k, v) of :func:`flash_forward` given its ``out`` and ``lse`` (which may be merged ones).

    torch's CPU backward runs one thread per (batch, head) pair, so a single pair (the by-key-block kernels' calls,
    :mod:`zoo.ops.block_grouped`) would use one core: its queries are cut into one piece per thread on the batch
    dimension instead (the keys shared, their gradients summed; zero rows pad the last piece and add nothing)."""
    one_pair = q.shape[0] * q.shape[1] == 1 and (mask is None or mask.shape[0] * mask.shape[1] == 1)
    if causal or not one_pair or torch.compiler.is_compiling():  # compiled graphs: no thread count to read
        return _flash_backward(grad, q, k, v, out, lse, mask, scale, causal)
    pieces = min(torch.get_num_threads(), q.shape[-2] // SPLIT_MIN_QUERIES)
    if pieces < 2:
        return _flash_backward(grad, q, k, v, out, lse, mask, scale, causal)
    count = q.shape[-2]
    size = -(-count // pieces)

    def split(x: torch.Tensor) -> torch.Tensor:  # (1, 1, count, ...) -> (pieces, 1, size, ...)
        x = x.flatten(0, 2)
        x = torch.cat([x, x.new_zeros(size * pieces - count, *x.shape[1:])]) if size * pieces > count else x
        return x.view(pieces, 1, size, *x.shape[1:])

    if mask is not None:
        mask = split(mask.expand(1, 1, count, k.shape[-2])) if mask.shape[-2] == count else mask
    gq, gk, gv = _flash_backward(split(grad), split(q), k.expand(pieces, -1, -1, -1), v.expand(pieces, -1, -1, -1),
                                 split(out), split(lse), mask, scale)
    return gq.view(1, 1, -1, gq.shape[-1])[:, :, :count], gk.sum(0, keepdim=True), gv.sum(0, keepdim=True)


SPLIT_MIN_QUERIES = 64  # a piece of fewer queries is not worth a thread


def _flash_backward(grad, q, k, v, out, lse, mask: torch.Tensor | None, scale: float, causal: bool = False):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )
