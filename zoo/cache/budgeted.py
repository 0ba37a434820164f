"""The budgeted cache of a pretrained model (:class:`BudgetedLayer`): sinks, recent keys and a budget of keys chosen
by a KV policy (:mod:`zoo.cache.policies`) per batch row and KV head."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from zoo.cache.policies import DEFAULT_POLICY, PolicySpec, as_policy, with_old_window
from zoo.cache.protocol import BatchMapped, CacheRollbackError, ZooCacheLayer, hand_to_kernel, tensor_bytes

HELD = ("keys", "values", "pos", "real", "mass")  # the per-key state, each a view of the first rows of a buffer
ROOM = 1  # rows of room a buffer keeps past tokens + slack: a decoding step writes its key in place, no copy


class PositionsExhaustedError(ValueError):
    """A budgeted cache was asked to go past the model's ``max_position_embeddings``."""


class BudgetedLayer(BatchMapped, ZooCacheLayer, DynamicLayer):
    """A bounded cache for a model trained with full attention: per batch row and KV head, the first ``sinks`` real
    tokens of the row, the last ``recent`` tokens and the ``tokens - sinks - recent`` other keys that score highest
    under ``policy`` (a :class:`~zoo.cache.policies.Policy`, a built-in one's name (:data:`POLICIES`) or a dict of its
    name and fields; default :data:`~zoo.cache.policies.DEFAULT_POLICY`). Once it holds
    more than ``tokens + slack`` keys it evicts down to ``tokens`` (``slack=0``: after every call); padding keys go
    first, sinks and recent keys never.
    Each (row, KV head) keeps its own tokens, the same count everywhere, so the tensors stay rectangular.

    Held state, per (row, KV head): ``keys``/``values`` (B, Hk, K, d), ``pos`` (B, Hk, K) token positions (ascending),
    ``real`` (not padding) and ``mass`` (accumulated attention, for policies that accumulate); and the last ``window``
    queries (``queries``, ``query_real``; the policy's :attr:`~zoo.cache.Policy.recorded_window`) for the policies
    that record them. ``window`` as an argument is deprecated (the policy's own field now). The kernel
    (the ``budget`` variant) reads them through ``call.cache`` and reports back with :meth:`observe`.
    ``key_positions`` (what the plug hands the kernel) are row 0 / head 0's: the positions of every row and head
    while nothing was evicted, and of the current call's tokens (the last ones) always. Keys keep their rotary phase
    (nothing is re-rotated); past ``max_positions`` tokens :meth:`update` refuses (:class:`PositionsExhaustedError`).

    Storage (what keeps a decoding step free of copies of the cache): the five per-key tensors are views of the first
    rows of buffers of ``tokens + slack + 1`` rows (:data:`ROOM`; while the cache grows towards that, a quarter more
    than it holds; a call of more tokens, as a prefill, gets exactly what it needs until its eviction). A new key is
    written in place; an eviction moves only the keys from the first evicted one on (the sinks and the recent keys
    stay where they are when the evicted keys are the oldest of the rest). :meth:`nbytes` counts the buffers, room
    included. The views are rewritten by later calls: clone them to keep a state.
    """

    is_sliding = False

    def __init__(self, tokens: int, sinks: int = 4, recent: int = 64, policy: PolicySpec = DEFAULT_POLICY,
                 slack: int = 0, window: int | None = None, max_positions: int | None = None) -> None:
        super().__init__()
        policy = as_policy(policy)
        if window is not None:
            policy = with_old_window(policy, window, "BudgetedLayer")
        if tokens < sinks + recent or min(sinks, recent, slack) < 0:
            raise ValueError(f"BudgetedLayer: need tokens >= sinks + recent and non-negative sizes, got tokens="
                             f"{tokens}, sinks={sinks}, recent={recent}, slack={slack}.")
        self.tokens, self.sinks, self.recent, self.slack = int(tokens), int(sinks), int(recent), int(slack)
        self.policy, self.max_positions = policy, max_positions
        self.window = policy.recorded_window
        self._clear()

    @property
    def accumulates(self) -> bool:
        """The policy needs every query's attention (H2O's): the kernel computes it at every call."""
        return self.policy.accumulates

    @property
    def records_queries(self) -> bool:
        return self.policy.records_queries

    def _clear(self) -> None:
        self.seen = self.new_tokens = 0
        self.evicted = False
        self.scaling = 1.0
        self.row_start: torch.Tensor | None = None
        self.key_positions = self.pos = self.real = self.mass = self.queries = self.query_real = None
        self.store: list[torch.Tensor] | None = None  # the buffers of HELD, rows [0, held) in use
        self.store_owner: int | None = None  # id() of the layer that made them (a copy of its __dict__ must not write)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, kv_heads = key_states.shape[:2]
        self.keys = key_states.new_empty(batch, kv_heads, 0, key_states.shape[-1])
        self.values = value_states.new_empty(batch, kv_heads, 0, value_states.shape[-1])
        self.pos = torch.zeros(batch, kv_heads, 0, dtype=torch.long, device=self.device)
        self.real = torch.zeros(batch, kv_heads, 0, dtype=torch.bool, device=self.device)
        self.mass = torch.zeros(batch, kv_heads, 0, device=self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        hand_to_kernel(self, kwargs)
        count = key_states.shape[-2]
        if self.max_positions is not None and self.seen + count > self.max_positions:
            raise PositionsExhaustedError(
                f"attention-zoo budget cache: {self.seen + count} tokens would pass the model's "
                f"max_position_embeddings={self.max_positions}. Kept keys keep their rotary phase (nothing is "
                "re-rotated), so the next tokens would sit at positions the model was never trained on; a bounded "
                "cache bounds memory, not positions. Shorten the prompt or max_new_tokens."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.keys.shape[-2]
        self._reserve(count)
        self._use(held + count)
        self.keys.narrow(2, held, count).copy_(key_states)
        self.values.narrow(2, held, count).copy_(value_states)
        self.pos.narrow(2, held, count).copy_(torch.arange(self.seen, self.seen + count, device=self.device))
        self.real.narrow(2, held, count).fill_(True)
        self.mass.narrow(2, held, count).zero_()
        self.seen += count
        self.new_tokens = count
        return self.keys, self.values

    def _use(self, rows: int) -> None:
        """Point the held tensors at the first ``rows`` rows of the buffers."""
        for name, buffer in zip(HELD, self.store, strict=True):
            setattr(self, name, buffer.narrow(2, 0, rows))
        self.key_positions = self.pos[0, 0]

    def _store_intact(self) -> bool:
        """The buffers are this layer's and the held tensors their first rows: nothing replaced them (a beam reorder,
        another layer's state copied in, as the KV benchmark's shared prefill does), so they may be written."""
        if self.store is None or self.store_owner != id(self):
            return False
        rows = self.keys.shape[-2]
        return all(
            view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride() and view.shape[2] == rows
            for view, buffer in zip((getattr(self, name) for name in HELD), self.store, strict=True)
        )

    def _reserve(self, count: int) -> None:
        """Room for ``count`` more rows in buffers of this layer's own: new buffers (the held rows copied in) when
        there is none; up to tokens + slack + ROOM rows, a quarter more than needed (amortised growth)."""
        rows = self.keys.shape[-2]
        need = rows + count
        if self._store_intact() and self.store[0].shape[2] >= need:
            return
        capacity = max(need, min(self.tokens + self.slack + ROOM, need + need // 4))
        self._allocate(capacity, [getattr(self, name) for name in HELD])

    def _allocate(self, capacity: int, held: list[torch.Tensor]) -> None:
        """New buffers of ``capacity`` rows holding ``held`` (the values of HELD) in their first rows."""
        self.store, self.store_owner = [], id(self)
        for tensor in held:
            buffer = tensor.new_empty(*tensor.shape[:2], capacity, *tensor.shape[3:])
            buffer.narrow(2, 0, tensor.shape[2]).copy_(tensor)
            self.store.append(buffer)
        self._use(held[0].shape[2])

    def key_columns(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Marks the call's padding tokens (they are never kept) and returns row 0 / head 0's columns (all of them
        while nothing was evicted; the kernel reads each head's own ``real`` after that)."""
        columns = super().key_columns(attention_mask)
        if columns is not None:
            self.real[..., -self.new_tokens :] = attention_mask[:, None, -self.new_tokens :].bool()
        return columns

    def observe(self, queries: torch.Tensor, mass: torch.Tensor | None, scaling: float,
                row_start: torch.Tensor | None) -> None:
        """Called by the kernel after each attention call: record what the policy scores from, then evict."""
        if row_start is not None:
            self.row_start = row_start.to(self.device)
        self.scaling = scaling
        if mass is not None:
            self.mass.add_(mass)
        if self.records_queries:
            new_real = self.real[:, 0, -self.new_tokens :]
            recent, recent_real = queries.detach()[..., -self.window :, :], new_real[:, -self.window :]
            if self.queries is not None:
                recent = torch.cat([self.queries, recent], dim=-2)[..., -self.window :, :]
                recent_real = torch.cat([self.query_real, recent_real], dim=-1)[:, -self.window :]
            self.queries, self.query_real = recent, recent_real
        if self.keys.shape[-2] > self.tokens + self.slack:
            self.evict()

    def scores(self) -> torch.Tensor:
        """(B, Hk, K) fp32, higher = keep: the policy's score of every held key."""
        return self.policy.score(self)

    def protected(self) -> torch.Tensor:
        """(B, Hk, K) bool: the sinks (the first ``sinks`` real tokens of each row) and the last ``recent`` tokens."""
        start = self.row_start[:, None, None] if self.row_start is not None else 0
        sinks = (self.pos >= start) & (self.pos < start + self.sinks)
        return sinks | (self.pos >= self.seen - self.recent)

    def evict(self) -> None:
        """Keep ``tokens`` keys per (row, KV head): the protected ones, then the highest scores; padding last. In
        place when the buffers are this layer's and no larger than tokens + slack + ROOM rows (then only the rows
        from the first evicted one on move); else into new buffers of that size (after a prefill, a chunk)."""
        keep = self.policy.keep(self)
        kept, capacity = keep.shape[-1], self.tokens + self.slack + ROOM
        if self._store_intact() and self.store[0].shape[2] <= capacity:
            moved = (keep != torch.arange(kept, device=keep.device)).flatten(0, 1).any(dim=0)
            first = int(moved.to(torch.uint8).argmax()) if bool(moved.any()) else kept
            for view, buffer in zip((getattr(self, name) for name in HELD), self.store, strict=True):
                view.narrow(2, first, kept - first).copy_(_take(buffer, keep[..., first:]))
            self._use(kept)
        else:
            self._allocate(max(capacity, kept), [_take(getattr(self, name).contiguous(), keep) for name in HELD])
        self.evicted = True

    def _map_state(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in ("keys", "values", "pos", "real", "mass", "queries", "query_real", "row_start"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and value.dim():
                setattr(self, name, fn(value))
        self.store = None  # the held tensors are new ones: the next write copies them into buffers
        if self.pos is not None:
            self.key_positions = self.pos[0, 0]

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens: always while nothing was evicted, then only the recent ones
        (every row and head holds them)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}.")
        count = -tokens_to_remove
        if not count or not self.is_initialized:
            return
        if self.evicted and count > self.recent:
            raise CacheRollbackError(
                f"attention-zoo BudgetedLayer cannot forget {count} tokens: past its {self.recent} protected recent "
                "tokens it has evicted keys the earlier state needs. Use recent >= the number of draft tokens."
            )
        keep = slice(0, self.keys.shape[-2] - count)
        self.keys, self.values = self.keys[..., keep, :], self.values[..., keep, :]
        self.pos, self.real, self.mass = self.pos[..., keep], self.real[..., keep], self.mass[..., keep]
        self.seen -= count
        self.key_positions = self.pos[0, 0]

    def reset(self) -> None:
        super().reset()
        self._clear()

    def nbytes(self) -> int:
        """Bytes held: the buffers, their room included (the held tensors when they are not views of them)."""
        held = self.store if self._store_intact() else [getattr(self, name) for name in HELD]
        return tensor_bytes([*held, self.queries, self.query_real])


def _take(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (B, Hk, n) of a contiguous (B, Hk, R[, d]) tensor, as (B, Hk, n[, d]): whole rows at a time
    (``index_select`` on the flattened rows; ``gather`` with the index expanded over d reads an index per value)."""
    batch, heads, rows = source.shape[:3]
    offsets = torch.arange(0, batch * heads * rows, rows, device=index.device).view(batch, heads, 1)
    taken = source.reshape(batch * heads * rows, -1).index_select(0, (index + offsets).flatten())
    return taken.view(*index.shape, *source.shape[3:])
