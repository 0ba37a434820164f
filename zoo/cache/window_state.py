"""The cache of a window and a state in one layer (:class:`WindowStateLayer`, the ``window_state`` variant's): the last
``window`` keys and values, the first ``sinks`` real tokens of each row, and a recurrent state holding every key that
has left the window."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zoo.cache.protocol import tensor_bytes
from zoo.cache.recurrent import RecurrentLayer


class WindowStateLayer(RecurrentLayer):
    """A ring of the last ``window`` tokens beside a recurrent state (:class:`RecurrentLayer`'s ``state``).

    Per token of the ring: its key and value (the window's softmax reads them), whether it is a real token, and what
    the state variant derived from it when it arrived (``tokens``: its feature-mapped key, value, gates, by name), so it
    enters the state unchanged when it leaves the ring. The first ``sinks`` real tokens of each row stay in
    ``sink_keys``/``sink_values`` (``sink_found`` (B, S)). ``update`` returns the new keys and values only; the kernel
    reads the ring (:meth:`ring`), runs, and hands back the newest ``window`` tokens (:meth:`keep`). A decoding step
    into a full ring of real tokens writes in place instead (:meth:`oldest`, then :meth:`push`): slot ``ring_head``
    holds the oldest token, so the ring is stored rotated and :meth:`ring` puts it back in position order. Bytes are
    bounded by the window, the sinks and the state, whatever the context. A state cannot be rolled back: ``crop``
    refuses.
    """

    def __init__(self, window: int, sinks: int) -> None:
        super().__init__()
        self.window, self.sinks = window, sinks
        self._clear_ring()

    def _clear_ring(self) -> None:
        self.ring_keys = self.ring_values = self.ring_real = None
        self.ring_head, self.ring_all_real = 0, False  # the oldest token's slot; every token held is real
        self.tokens: dict[str, torch.Tensor] = {}
        self.sink_keys = self.sink_values = self.sink_found = None

    def held(self) -> int:
        return 0 if self.ring_keys is None else self.ring_keys.shape[-2]

    def ring(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
        """(keys (B, H, R, d), values, real (B, R), the state variant's per-token tensors) of the R tokens held, in
        position order."""
        if self.ring_head:  # decoding steps wrote over the oldest slots: unrotate (a copy, outside decoding only)
            self._map_ring(lambda x: x.roll(-self.ring_head, dims=2 if x.dim() > 2 else 1))
            self.ring_head = 0
        return self.ring_keys, self.ring_values, self.ring_real, self.tokens

    def keep(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor, tokens: dict[str, torch.Tensor]
             ) -> None:
        """Hold the newest ``window`` of these tokens (the ring and the call's, in position order), as copies that
        decoding steps may write over."""
        kept = min(self.window, keys.shape[-2])
        self.ring_keys, self.ring_values = keys[:, :, -kept:].detach().clone(), values[:, :, -kept:].detach().clone()
        self.ring_real = real[:, -kept:]
        self.tokens = {name: tensor[:, :, -kept:].detach().clone() for name, tensor in tokens.items()}
        self.ring_head, self.ring_all_real = 0, bool(self.ring_real.all())

    def steps_in_place(self) -> bool:
        """Whether a one-token step can write over the oldest slot: the ring is full of real tokens."""
        return self.ring_all_real and self.held() == self.window

    def oldest(self) -> dict[str, torch.Tensor]:
        """The state variant's tensors of the oldest token held (B, H, 1, ...): the one the next step pushes out."""
        slot = self.ring_head
        return {name: tensor[:, :, slot : slot + 1] for name, tensor in self.tokens.items()}

    def push(self, key: torch.Tensor, value: torch.Tensor, tokens: dict[str, torch.Tensor]) -> None:
        """Write one real token (B, H, 1, ...) over the oldest, once :meth:`oldest` has gone into the state."""
        slot = self.ring_head
        self.ring_keys[:, :, slot : slot + 1] = key
        self.ring_values[:, :, slot : slot + 1] = value
        for name, tensor in tokens.items():
            self.tokens[name][:, :, slot : slot + 1] = tensor
        self.ring_head = (slot + 1) % self.window

    def _map_ring(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.tokens = {name: fn(tensor) for name, tensor in self.tokens.items()}
        for name in ("ring_keys", "ring_values", "ring_real"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))

    def keep_sinks(self, keys: torch.Tensor, values: torch.Tensor, found: torch.Tensor) -> None:
        self.sink_keys, self.sink_values, self.sink_found = keys.detach(), values.detach(), found

    rollback_refusal = (
        "attention-zoo WindowStateLayer cannot forget tokens: the keys that left its window are summed into a "
        "recurrent state, which cannot be rolled back. Assisted decoding needs a variant that keeps keys (e.g. sdpa, "
        "longformer)."
    )

    def _map_state(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super()._map_state(fn)
        self._map_ring(fn)
        for name in ("sink_keys", "sink_values", "sink_found"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))

    def reset(self) -> None:
        super().reset()
        self._clear_ring()

    def nbytes(self) -> int:
        held = [self.ring_keys, self.ring_values, self.ring_real, self.sink_keys, self.sink_values, self.sink_found]
        return tensor_bytes([*self.state.values(), *self.tokens.values(), *held])
