"""The cache of a recurrent state instead of keys (:class:`RecurrentLayer`), for linear-attention variants."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from zoo.cache.protocol import BatchMapped, CacheRollbackError, ZooCacheLayer, hand_to_kernel, tensor_bytes


class RecurrentLayer(BatchMapped, ZooCacheLayer, CacheLayerMixin):
    """A recurrent state instead of keys: named tensors with the batch first (``state``), which the kernel
    reads and replaces at every call. ``update`` returns the new keys and values only; the kernel continues
    from ``state`` (an empty dict before the first token). A running sum cannot forget tokens: ``crop`` raises.
    """

    is_croppable = False
    is_compileable = False

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0
        self.new_tokens = 0
        self.state: dict[str, torch.Tensor] = {}
        self.key_positions = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        hand_to_kernel(self, kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        count = key_states.shape[-2]
        self.key_positions = torch.arange(self.seen, self.seen + count, device=self.device)
        self.seen += count
        self.new_tokens = count
        return key_states, value_states

    rollback_refusal = (
        "attention-zoo RecurrentLayer cannot forget tokens: its state is a running sum over every token seen "
        "(linear attention), which cannot be rolled back. Assisted decoding and other rollbacks need a variant "
        "that keeps keys (e.g. longformer, xformers with a window, sdpa)."
    )

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise CacheRollbackError(self.rollback_refusal)

    def _map_state(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.state = {name: fn(tensor) for name, tensor in self.state.items()}

    def offload(self) -> None:
        self._map_state(lambda x: x.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:
            self._map_state(lambda x: x.to(self.device, non_blocking=True))

    def reset(self) -> None:
        self.state, self.seen, self.new_tokens, self.key_positions = {}, 0, 0, None

    def nbytes(self) -> int:
        return tensor_bytes(self.state.values())

