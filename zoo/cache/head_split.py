"""The cache of a head-level layout (:class:`HeadSplitLayer`, the ``duo`` variant's): the full heads keep every key,
the streaming heads keep their sinks and last ``recent`` keys, in one layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from zoo.cache.budgeted import BudgetedLayer, PositionsExhaustedError
from zoo.cache.growing import GrowingLayer
from zoo.cache.protocol import BatchMapped, CacheRollbackError, ZooCacheLayer, hand_to_kernel, tensor_bytes
from zoo.ops.streaming import gather_sinks, sink_positions


class HeadSplitLayer(BatchMapped, ZooCacheLayer, CacheLayerMixin):
    """Per KV head what its attention reaches: the ``full_heads`` (KV head indices) every key, in a
    :class:`GrowingLayer` (amortized appends), or what a :class:`BudgetedLayer` keeps of them (``full_budget``: the
    prompt's length -> the layer, e.g. SnapKV on the full heads); every other KV head the first ``sinks`` real
    tokens of each row and the last ``recent`` keys, in one fixed buffer per tensor (``stream_keys``,
    ``stream_values`` (B, Hs, sinks + recent, d): the sinks, then a ring where position p sits in slot p % recent).
    ``update`` returns the new keys and values only; the kernel reads the layer (``call.cache``).

    A decoding step of one token once the ring is full writes it into its slot (the key leaving the window) and the
    kernel attends to the whole buffer, no copy and no mask (:meth:`fast`); any other call gets the window in position
    order (:meth:`window_run`: the ring, then the call's tokens) and the sinks (:meth:`sinks_for_call`).
    The plug's key positions (``key_positions``) are every position while some head is full, else the window run's,
    so the padding mask handed to the kernel ends with the run's columns either way. A bounded layer bounds memory,
    not positions: past ``max_positions`` tokens :meth:`update` refuses, as the budgeted cache does.
    """

    is_compileable = False
    is_sliding = False

    def __init__(self, full_heads: list[int], sinks: int, recent: int, max_positions: int | None = None,
                 full_budget: Callable[[int], BudgetedLayer] | None = None) -> None:
        super().__init__()
        self.full_heads, self.sinks, self.recent, self.max_positions = list(full_heads), sinks, recent, max_positions
        self.full_budget = full_budget
        self._clear()

    def _clear(self) -> None:
        self.seen = self.new_tokens = self.held = 0
        self.full: GrowingLayer | BudgetedLayer | None = None
        self.full_index = self.stream_index = None
        self.stream_keys = self.stream_values = self.sink_have = self.run = None
        self.row_start = self.sink_pos = self.key_positions = None
        self.rows_known = self.sinks_complete = False
        self.sink_end = self.sinks

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        kv_heads = key_states.shape[1]
        streaming = [head for head in range(kv_heads) if head not in self.full_heads]
        self.full_index = torch.tensor(self.full_heads, dtype=torch.long, device=self.device)
        self.stream_index = torch.tensor(streaming, dtype=torch.long, device=self.device)
        self.full = None
        if self.full_heads:  # a budget on the full heads is sized by the first call (the prompt)
            self.full = self.full_budget(key_states.shape[-2]) if self.full_budget else GrowingLayer()
        if streaming:
            batch, rows = key_states.shape[0], self.sinks + self.recent
            self.stream_keys = key_states.new_zeros(batch, len(streaming), rows, key_states.shape[-1])
            self.stream_values = value_states.new_zeros(batch, len(streaming), rows, value_states.shape[-1])
            self.sink_have = torch.zeros(batch, self.sinks, dtype=torch.bool, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        hand_to_kernel(self, kwargs)
        count = key_states.shape[-2]
        if self.max_positions is not None and self.seen + count > self.max_positions:
            raise PositionsExhaustedError(
                f"attention-zoo head-split cache: {self.seen + count} tokens would pass the model's "
                f"max_position_embeddings={self.max_positions}; the streaming heads bound memory, not positions. "
                "Shorten the prompt or max_new_tokens."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.full is not None:
            keys, values = key_states.index_select(1, self.full_index), value_states.index_select(1, self.full_index)
            if isinstance(self.full, BudgetedLayer):
                self.full.update(keys, values, kwargs={})  # the kernel reaches it through this layer
            else:
                self.full.update(keys, values)
        if self.stream_keys is not None:
            keys = key_states.index_select(1, self.stream_index)
            values = value_states.index_select(1, self.stream_index)
            if count == 1 and self.held == self.recent:  # the new key takes the slot of the one leaving the window
                slot = self.sinks + self.seen % self.recent
                self.stream_keys[:, :, slot] = keys[:, :, 0]
                self.stream_values[:, :, slot] = values[:, :, 0]
            else:
                ring_keys, ring_values = self._ordered_ring(self.seen)
                self.run = (torch.cat([ring_keys, keys], dim=-2), torch.cat([ring_values, values], dim=-2))
        self.seen += count
        self.new_tokens = count
        if self.stream_keys is not None:
            self.held = min(self.recent, self.held + count)
        length = self.seen if self.full is not None else (self.run[0].shape[-2] if self.run else self.held)
        self.key_positions = torch.arange(self.seen - length, self.seen, device=self.device)
        return key_states, value_states

    def _ordered_ring(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring's keys and values in position order: the ``held`` positions before ``end``."""
        slots = self.sinks + torch.arange(end - self.held, end, device=self.device) % self.recent
        return self.stream_keys.index_select(2, slots), self.stream_values.index_select(2, slots)

    def window_run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The streaming heads' latest keys and values in position order, ending at the newest token."""
        return self.run if self.run is not None else self._ordered_ring(self.seen)

    def fast(self, padding_mask: torch.Tensor | None) -> bool:
        """The whole buffer is what a one-token query of every row sees, once: the ring is full, every sink is in and
        out of the window, and no key is padding."""
        return (self.run is None and padding_mask is None and self.sinks_complete and
                self.seen - self.recent >= self.sink_end)

    def key_columns(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        if isinstance(self.full, BudgetedLayer):  # it marks the call's padding tokens as never kept
            self.full.key_columns(attention_mask)
        return super().key_columns(attention_mask)

    def set_row_start(self, row_start: torch.Tensor | None) -> None:
        self.row_start = row_start
        if self.stream_keys is not None:
            self.sink_pos = sink_positions(row_start, self.stream_keys.shape[0], self.sinks, self.device)
            self.sink_end = int(self.sink_pos.max()) + 1 if self.sinks else 0
        self.rows_known = True

    def sinks_for_call(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sinks a call reads: those kept, else those in the window run. (keys, values, positions (B, S), −1
        where a row has none yet)."""
        sink_keys, sink_values = self.stream_keys[:, :, : self.sinks], self.stream_values[:, :, : self.sinks]
        if self.sinks_complete:  # every row holds its sinks: nothing to gather
            return sink_keys, sink_values, self.sink_pos
        keys, values = self.window_run()
        gathered_keys, gathered_values, found = gather_sinks(keys, values, self.sink_pos, self.seen - keys.shape[-2])
        have = self.sink_have[:, None, :, None]
        keys, values = torch.where(have, sink_keys, gathered_keys), torch.where(have, sink_values, gathered_values)
        valid = self.sink_have | found
        return keys, values, torch.where(valid, self.sink_pos, torch.full_like(self.sink_pos, -1))

    def after_call(self) -> None:
        """Keep the sinks the call brought, then the run's last ``recent`` keys in the ring."""
        if self.stream_keys is None:
            return
        if not self.sinks_complete:
            keys, values, positions = self.sinks_for_call()
            self.stream_keys[:, :, : self.sinks], self.stream_values[:, :, : self.sinks] = keys, values
            self.sink_have = positions >= 0
            self.sinks_complete = bool(self.sink_have.all())
        if self.run is not None:
            keys, values = self.run
            kept = min(self.recent, keys.shape[-2])
            slots = self.sinks + torch.arange(self.seen - kept, self.seen, device=self.device) % self.recent
            self.stream_keys.index_copy_(2, slots, keys[:, :, -kept:])
            self.stream_values.index_copy_(2, slots, values[:, :, -kept:])
            self.run = None

    def _map_state(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in ("stream_keys", "stream_values", "sink_have", "sink_pos", "row_start"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and value.dim():
                setattr(self, name, fn(value))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        BatchMapped.reorder_cache(self, beam_idx)
        if self.full is not None:
            self.full.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        BatchMapped.batch_repeat_interleave(self, repeats)
        if self.full is not None:
            self.full.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        BatchMapped.batch_select_indices(self, indices)
        if self.full is not None:
            self.full.batch_select_indices(indices)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise CacheRollbackError(
            "attention-zoo HeadSplitLayer cannot forget tokens: its streaming heads dropped keys the earlier state "
            "needs. Assisted decoding needs a cache that keeps every key (e.g. sdpa, or budget with recent >= the "
            "number of draft tokens)."
        )

    def reset(self) -> None:
        self._clear()
        self.is_initialized = False

    def nbytes(self) -> int:
        held = [self.stream_keys, self.stream_values, self.sink_have]
        if isinstance(self.full, BudgetedLayer):
            return tensor_bytes(held) + self.full.nbytes()
        if self.full is not None:
            held += [self.full.keys, self.full.values, *(self.full.buffers or ())]
        return tensor_bytes(held)
