"""Whole-block gathers through ``index_select``: each selected block is one contiguous copy of
``block * head_dim`` values, and the backward is an ``index_add_`` of whole blocks. On CPU this is about twice
as fast (forward + backward) as the element-wise ``torch.gather`` of :func:`zoo.ops.gather_blocks`, with the
same result."""

from __future__ import annotations

import torch


def select_blocks(x: torch.Tensor, block: int, block_index: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`zoo.ops.gather_blocks`.

    x: (B, H, N, D) with N a multiple of ``block`` (any strides); block_index: (H or 1, G, R) long indices of key
    blocks for each of G query blocks. Returns a contiguous (B, H, G, R * block, D).
    """
    b, h, n, d = x.shape
    num_blocks = n // block
    _, g, r = block_index.shape
    flat = x.reshape(b, h * num_blocks, block, d)
    head_offsets = torch.arange(h, device=block_index.device)[:, None, None] * num_blocks
    index = (block_index.expand(h, g, r) + head_offsets).reshape(-1)
    return flat.index_select(1, index).view(b, h, g, r * block, d)
