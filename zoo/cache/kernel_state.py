"""A cache of every key that also keeps state of the variant's kernel per row (:class:`KernelStateLayer`): what
content-selecting variants need to choose keys while decoding (``moba``'s block means, ``dsa``'s indexer keys)."""

from __future__ import annotations

import torch

from zoo.cache.growing import GrowingLayer
from zoo.cache.protocol import BatchMapped, ZooCacheLayer, hand_to_kernel


class KernelStateLayer(BatchMapped, ZooCacheLayer, GrowingLayer):
    """Every key (:class:`zoo.cache.GrowingLayer`; the plug speaks to it as a :class:`zoo.cache.ZooCacheLayer`),
    handed to the kernel (``call.cache``) with per-row state the kernel keeps in it (``state_names``: tensors with the
    batch first, or None), reordered with the beams (:class:`zoo.cache.BatchMapped`, keys and values with them) and
    counted by :meth:`nbytes`. The kernel sees keys at positions 0 .. n - 1 and the padding mask over all of them."""

    state_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.clear_state()

    def clear_state(self) -> None:
        for name in self.state_names:
            setattr(self, name, None)

    @property
    def seen(self) -> int:
        return GrowingLayer.get_seq_length(self)  # every key held (ZooCacheLayer's get_seq_length reads seen)

    @property
    def key_positions(self) -> torch.Tensor:
        return torch.arange(self.seen, device=self.keys.device)

    def key_columns(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Every key is kept: the padding mask over every token seen, as it is."""
        if attention_mask is not None and attention_mask.shape[-1] != self.seen:
            raise ValueError(
                f"attention-zoo {type(self).__name__}: the padding mask covers {attention_mask.shape[-1]} tokens but "
                f"the cache has seen {self.seen}. Pass an attention_mask over every token so far (as generate does)."
            )
        return attention_mask

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        hand_to_kernel(self, kwargs)
        return super().update(key_states, value_states, *args, **kwargs)

    def _map_state(self, fn) -> None:
        for name in ("keys", "values", *self.state_names):
            value = getattr(self, name, None)
            if isinstance(value, torch.Tensor):
                setattr(self, name, fn(value))
        self._rebuilt()  # the growing buffers no longer hold the keys

    def reset(self) -> None:
        super().reset()
        self.clear_state()

    def row_starts(self, row_start: torch.Tensor | None) -> torch.Tensor:
        """(B,) long: each row's first real token (0 without left padding), on the keys' device."""
        keys = self.keys
        if row_start is None:
            return keys.new_zeros(keys.shape[0], dtype=torch.long)
        return row_start.to(keys.device)

    def nbytes(self) -> int:
        state = (getattr(self, name) for name in self.state_names)
        return super().nbytes() + sum(x.numel() * x.element_size() for x in state if x is not None)


def complete_blocks(n: int, starts: torch.Tensor, block: int, stride: int) -> torch.Tensor:
    """(B,) long: how many blocks of ``block`` tokens every ``stride`` tokens from each row's start ``starts`` (B,)
    are complete among n tokens."""
    return (torch.div(n - starts - block, stride, rounding_mode="floor") + 1).clamp(min=0)


def row_blocks(x: torch.Tensor, starts: torch.Tensor, padding_mask: torch.Tensor | None, numbers: torch.Tensor,
               block: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``numbers`` (J,) of each row of ``x`` (B, H, n, D), block j holding tokens ``start + j·stride`` ..
    ``+ block - 1``: (blocks (B, H, J, block, D), real (B, J, block) bool: inside the n tokens and not padding)."""
    batch, heads, n, dim = x.shape
    positions = starts[:, None, None] + (numbers * stride)[None, :, None] + torch.arange(block, device=x.device)
    real = positions < n
    positions = positions.clamp(max=n - 1)
    if padding_mask is not None:
        real = real & padding_mask.bool()[torch.arange(batch, device=x.device)[:, None, None], positions]
    index = positions.view(batch, 1, -1, 1).expand(batch, heads, -1, dim)
    return x.gather(2, index).view(batch, heads, len(numbers), block, dim), real
