"""The cache of every key in buffers that grow geometrically (:class:`GrowingLayer`)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from zoo.cache.protocol import tensor_bytes


class GrowingLayer(DynamicLayer):
    """Every key, like ``DynamicLayer``, but in buffers that grow geometrically (by an eighth, at least
    ``MIN_GROWTH`` tokens): appending a token costs O(new tokens) amortized instead of copying the whole cache
    (``DynamicLayer`` concatenates at every step, O(n) per token), for at most 1/8 of unused capacity.
    ``update`` returns views of the filled part. For variants that may reach any earlier key but look at few
    (bigbird, strided sparse_transformer). The kernel sees what ``DynamicLayer`` gives: keys at positions 0 .. n-1.
    """

    MIN_GROWTH = 256

    def __init__(self) -> None:
        super().__init__()
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if key_states.requires_grad or value_states.requires_grad:  # in-place writes would break autograd
            self.buffers = None
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        needed = length + key_states.shape[-2]
        if self.buffers is None or self.buffers[0].shape[-2] < needed:
            capacity = needed + max(self.MIN_GROWTH, needed // 8)
            self.buffers = tuple(_grown(x, old, capacity, length) for x, old in
                                 ((key_states, self.keys), (value_states, self.values)))
        for buffer, new in zip(self.buffers, (key_states, value_states), strict=True):
            buffer[..., length:needed, :].copy_(new)
        self.keys, self.values = (buffer[..., :needed, :] for buffer in self.buffers)
        return self.keys, self.values

    def _rebuilt(self) -> None:
        self.buffers = None  # keys/values were replaced (beam reorder, batch selection): grow again from them

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._rebuilt()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._rebuilt()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._rebuilt()

    def reset(self) -> None:
        super().reset()
        self.buffers = None

    def nbytes(self) -> int:
        return tensor_bytes(self.buffers if self.buffers is not None else (self.keys, self.values))


def _grown(like: torch.Tensor, old: torch.Tensor, capacity: int, length: int) -> torch.Tensor:
    buffer = like.new_empty(*like.shape[:-2], capacity, like.shape[-1])
    if length:
        buffer[..., :length, :].copy_(old)
    return buffer
