"""The budgeted cache of a pretrained model (:class:`BudgetedLayer`): sinks, recent keys and a budget of keys chosen
by a KV policy (:mod:`zoo.cache.policies`) per batch row and KV head."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from zoo.cache.policies import DEFAULT_POLICY, PolicySpec, as_policy, with_old_window
from zoo.cache.protocol import BatchMapped, CacheRollbackError, ZooCacheLayer, hand_to_kernel, tensor_bytes


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
        batch, kv_heads = key_states.shape[:2]
        new_pos = torch.arange(self.seen, self.seen + count, device=self.device).expand(batch, kv_heads, count)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.pos = torch.cat([self.pos, new_pos], dim=-1)
        self.real = torch.cat([self.real, self.real.new_ones(batch, kv_heads, count)], dim=-1)
        self.mass = torch.cat([self.mass, self.mass.new_zeros(batch, kv_heads, count)], dim=-1)
        self.seen += count
        self.new_tokens = count
        self.key_positions = self.pos[0, 0]
        return self.keys, self.values

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
            self.mass = self.mass + mass
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
        """Keep ``tokens`` keys per (row, KV head): the protected ones, then the highest scores; padding last."""
        keep = self.policy.keep(self)
        rows = keep[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self.keys, self.values = self.keys.gather(2, rows), self.values.gather(2, rows)
        self.pos, self.real, self.mass = (x.gather(2, keep) for x in (self.pos, self.real, self.mass))
        self.key_positions = self.pos[0, 0]
        self.evicted = True

    def _map_state(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in ("keys", "values", "pos", "real", "mass", "queries", "query_real", "row_start"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and value.dim():
                setattr(self, name, fn(value))
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
        return tensor_bytes([self.keys, self.values, self.pos, self.real, self.mass, self.queries, self.query_real])
