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
    reads the ring (:meth:`ring`), runs, and hands back the newest ``window`` tokens (:meth:`keep`). Bytes are bounded
    by the window, the sinks and the state, whatever the context. A state cannot be rolled back: ``crop`` refuses.
    """

    def __init__(self, window: int, sinks: int) -> None:
        super().__init__()
        self.window, self.sinks = window, sinks
        self._clear_ring()

    def _clear_ring(self) -> None:
        self.ring_keys = self.ring_values = self.ring_real = None
        self.tokens: dict[str, torch.Tensor] = {}
        self.sink_keys = self.sink_values = self.sink_found = None

    def held(self) -> int:
        return 0 if self.ring_keys is None else self.ring_keys.shape[-2]

    def ring(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
        """(keys (B, H, R, d), values, real (B, R), the state variant's per-token tensors) of the R tokens held."""
        return self.ring_keys, self.ring_values, self.ring_real, self.tokens

    def keep(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor, tokens: dict[str, torch.Tensor]
             ) -> None:
        """Hold the newest ``window`` of these tokens (the ring and the call's, in position order)."""
        kept = min(self.window, keys.shape[-2])
        self.ring_keys, self.ring_values = keys[:, :, -kept:].detach(), values[:, :, -kept:].detach()
        self.ring_real = real[:, -kept:]
        self.tokens = {name: tensor[:, :, -kept:].detach() for name, tensor in tokens.items()}

    def keep_sinks(self, keys: torch.Tensor, values: torch.Tensor, found: torch.Tensor) -> None:
        self.sink_keys, self.sink_values, self.sink_found = keys.detach(), values.detach(), found

    rollback_refusal = (
        "attention-zoo WindowStateLayer cannot forget tokens: the keys that left its window are summed into a "
        "recurrent state, which cannot be rolled back. Assisted decoding needs a variant that keeps keys (e.g. sdpa, "
        "longformer)."
    )

    def _map_state(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super()._map_state(fn)
        self.tokens = {name: fn(tensor) for name, tensor in self.tokens.items()}
        for name in ("ring_keys", "ring_values", "ring_real", "sink_keys", "sink_values", "sink_found"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))

    def reset(self) -> None:
        super().reset()
        self._clear_ring()

    def nbytes(self) -> int:
        held = [self.ring_keys, self.ring_values, self.ring_real, self.sink_keys, self.sink_values, self.sink_found]
        return tensor_bytes([*self.state.values(), *self.tokens.values(), *held])
