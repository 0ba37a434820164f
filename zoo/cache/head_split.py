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
    tokens of each row (``sink_keys``/``sink_values`` (B, Hs, sinks, d), ``sink_have`` (B, sinks)) and the latest
    keys (``window_keys``, ``window_values`` (B, Hs, L, d) at positions ``seen − L .. seen − 1``), cut to the last
    ``recent`` once each call is done. ``update`` returns the new keys and values only; the kernel reads the layer
    (``call.cache``).

    The plug's key positions (``key_positions``) are every position while some head is full, else the window's, so
    the padding mask handed to the kernel ends with the window's columns either way. A bounded layer bounds memory,
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
        self.seen = self.new_tokens = 0
        self.full: GrowingLayer | None = None
        self.full_index = self.stream_index = None
        self.window_keys = self.window_values = self.sink_keys = self.sink_values = self.sink_have = None
        self.row_start = self.sink_pos = self.key_positions = None
        self.rows_known = self.sinks_complete = False

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
            batch, dim = key_states.shape[0], key_states.shape[-1]
            self.window_keys = key_states.new_empty(batch, len(streaming), 0, dim)
            self.window_values = value_states.new_empty(batch, len(streaming), 0, value_states.shape[-1])
            self.sink_keys = key_states.new_zeros(batch, len(streaming), self.sinks, dim)
            self.sink_values = value_states.new_zeros(batch, len(streaming), self.sinks, value_states.shape[-1])
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
        if self.window_keys is not None:
            self.window_keys = torch.cat([self.window_keys, key_states.index_select(1, self.stream_index)], dim=-2)
            self.window_values = torch.cat([self.window_values, value_states.index_select(1, self.stream_index)],
                                           dim=-2)
        self.seen += count
        self.new_tokens = count
        held = self.seen if self.full is not None else self.window_keys.shape[-2]
        self.key_positions = torch.arange(self.seen - held, self.seen, device=self.device)
        return key_states, value_states

    def key_columns(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        if isinstance(self.full, BudgetedLayer):  # it marks the call's padding tokens as never kept
            self.full.key_columns(attention_mask)
        return super().key_columns(attention_mask)

    def set_row_start(self, row_start: torch.Tensor | None) -> None:
        self.row_start = row_start
        batch = self.window_keys.shape[0] if self.window_keys is not None else 0
        if batch:
            self.sink_pos = sink_positions(row_start, batch, self.sinks, self.device)
        self.rows_known = True

    def sinks_for_call(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sinks a call reads: those kept, else those still in the window run. (keys, values, positions (B, S),
        −1 where a row has none yet)."""
        if self.sinks_complete:  # every row holds its sinks: nothing to gather
            return self.sink_keys, self.sink_values, self.sink_pos
        first = self.seen - self.window_keys.shape[-2]
        keys, values, found = gather_sinks(self.window_keys, self.window_values, self.sink_pos, first)
        have = self.sink_have[:, None, :, None]
        keys = torch.where(have, self.sink_keys, keys)
        values = torch.where(have, self.sink_values, values)
        valid = self.sink_have | found
        return keys, values, torch.where(valid, self.sink_pos, torch.full_like(self.sink_pos, -1))

    def after_call(self) -> None:
        """Keep the sinks the call brought, then cut the window to the last ``recent`` keys."""
        if self.window_keys is None:
            return
        if not self.sinks_complete:
            keys, values, positions = self.sinks_for_call()
            self.sink_keys, self.sink_values, self.sink_have = keys, values, positions >= 0
            self.sinks_complete = bool(self.sink_have.all())
        if self.window_keys.shape[-2] > self.recent:  # a copy, so the longer run's storage is freed
            self.window_keys = self.window_keys[:, :, -self.recent :].clone()
            self.window_values = self.window_values[:, :, -self.recent :].clone()

    def _map_state(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in ("window_keys", "window_values", "sink_keys", "sink_values", "sink_have", "sink_pos",
                     "row_start"):
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
        held = [self.window_keys, self.window_values, self.sink_keys, self.sink_values, self.sink_have]
        if isinstance(self.full, BudgetedLayer):
            return tensor_bytes(held) + self.full.nbytes()
        if self.full is not None:
            held += [self.full.keys, self.full.values, *(self.full.buffers or ())]
        return tensor_bytes(held)
