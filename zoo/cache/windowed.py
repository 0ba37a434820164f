"""The window cache: :class:`WindowedLayer` keeps the sinks (keys kept forever) and the last ``reach`` keys, in buffers
with slack so that a decoding step copies O(new tokens) rows. :func:`pattern_cache_layer` (the default of
:meth:`zoo.variant.Variant.cache_layer`) builds one from a variant's causal pattern; the layer memoizes that pattern
(:meth:`WindowedLayer.decoding_pattern`) for the cache and the kernel alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from zoo.cache.protocol import (
    LAYER_KWARG,
    PER_STEP_KWARGS,
    CacheRollbackError,
    ZooCacheLayer,
    hand_to_kernel,
    tensor_bytes,
)
from zoo.call import AttentionCall
from zoo.pattern import Pattern, TokenSet

# (positions (K,), attention kwargs, row_start (B,) | None) -> (K,) bool: keys kept forever (any row's sink)
SinkPredicate = Callable[[torch.Tensor, dict, "torch.Tensor | None"], "torch.Tensor | None"]


class PatternSource(Protocol):
    """What the window cache asks of a variant: its pattern for a call (:meth:`zoo.variant.Variant.pattern`)."""

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int) -> Pattern | None: ...


@dataclass
class PatternMemo:
    """The decoding pattern a :class:`WindowedLayer` built last (for ``variant`` at ``layer_idx`` with ``row_start``
    and the attention kwargs but :data:`PER_STEP_KWARGS`, ``kwargs``) and what the cache read from it once:
    ``facts`` = (the last sink position, None if unknown; the first position past every global query), for the
    kwargs object ``facts_for`` (the layer's own copy, asked twice per step)."""

    variant: PatternSource
    layer_idx: int
    row_start: torch.Tensor | None
    kwargs: dict
    pattern: Pattern
    facts: tuple[int | None, int] | None = None
    facts_for: dict | None = None


def _lazy_view(name: str) -> property:
    """A :class:`WindowedLayer` attribute (``keys``, ``values``, ``positions``, ``is_sink``): a view of ``[lo, hi)`` of
    its buffers, made again only when read after a drop (a decoding step's drop and append narrow the buffers once)."""
    field = "_" + name

    def get(layer):
        if layer._stale:
            layer._set_views()
        return getattr(layer, field, None)

    def set_(layer, value):
        if layer._stale:
            layer._set_views()
        setattr(layer, field, value)

    return property(get, set_)


class WindowedLayer(ZooCacheLayer, DynamicLayer):
    """Keys a windowed pattern can still reach: every sink (global) key and the last ``reach`` keys.

    A future query at position p may see keys p - reach .. p and the sinks, so the layer drops the non-sink keys
    older than ``seen - reach`` -- once the attention call is done (:meth:`after_call`, from the plug; else at the next
    update), and once the call has told it where each row's real tokens start (``row_start``, set by the plug: left
    padding moves the first real tokens).
    ``sinks(positions, attention_kwargs, row_start) -> (len,) bool`` (or None: none of them) marks keys kept
    forever (e.g. StreamingLLM's first tokens, Longformer's global tokens, union over the batch);
    ``sees_all_until(attention_kwargs, row_start) -> int``: every key is kept while fewer tokens were seen (a global
    query still to come attends to all earlier keys); ``sink_horizon(attention_kwargs, row_start) -> int | None``: no
    sink lies past this position (None: unknown), so a step past it asks ``sinks`` nothing. Or, instead of the three,
    ``source`` (a variant) and ``layer_idx``: they come from its decoding pattern (:func:`pattern_cache_layer`), read
    once per pattern (one memo, :meth:`decoding_pattern`, shared with the kernel).

    Layout (what keeps the per-token work free of searches, gathers and copies of the window): the held keys are the
    old sinks (``sink_prefix`` of them, positions below ``first_recent``, in no particular order) followed by every
    position from ``first_recent`` on (ascending), a view ``[lo, hi)`` of buffers with slack after it. A new token is
    written at ``hi``; a dropped key moves ``lo`` on and the first sinks into its slot, so a decoding step copies
    O(new tokens) rows, not the window (the buffers are compacted when full: amortized O(1) per token for a slack of a
    quarter). ``key_positions`` / ``key_is_sink`` describe the keys handed to the current call, and :meth:`select`
    names the ones a window of queries can reach, as a slice (a view) when they are contiguous, which is always the
    case for one decoding step. ``crop`` restores what it can: with ``activate_past_recording()`` (assisted decoding)
    nothing is dropped until the next ``crop``. The attention kwargs kept for the sinks hold no reference to the
    layer itself (no reference cycle for walkers of its attributes).
    """

    is_sliding = False  # mask sizes cover every token seen, not a window
    MIN_SLACK = 64
    _stale = False  # the views lag the buffers (after a drop): refreshed on the next read (_lazy_view)

    def __init__(self, reach: int, sinks: SinkPredicate | None = None,
                 sees_all_until: Callable[[dict, torch.Tensor | None], int] | None = None,
                 sink_horizon: Callable[[dict, torch.Tensor | None], int | None] | None = None,
                 source: PatternSource | None = None, layer_idx: int = 0) -> None:
        super().__init__()
        self.reach = int(reach)
        self.source, self.layer_idx = source, layer_idx
        if source is not None:
            sinks, sees_all_until, sink_horizon = self._pattern_sinks, self._sees_all_until, self._sink_horizon
        self.sinks = sinks
        self.sees_all_until = sees_all_until
        self.sink_horizon = sink_horizon
        self.record_past = False
        self._clear()

    def _clear(self) -> None:
        self._stale = False
        self.seen = self.new_tokens = self.complete_until = self.pending = 0
        self.row_start: torch.Tensor | None = None
        self.rows_known = False  # row_start set by the plug (after the first call's update)
        self.attention_kwargs: dict = {}
        self.first_recent = self.sink_prefix = 0  # the held layout (see the class docstring)
        self.last_sink = -1  # the largest position marked as a sink so far (no sink after it)
        self.call_first = self.call_prefix = 0  # the same for the keys of the current call
        self.positions = self.is_sink = None
        self.key_positions = self.key_is_sink = None
        self.buffers: list[torch.Tensor] | None = None  # keys, values, positions, is_sink; held: [lo, hi)
        self.lo = self.hi = 0
        self.views: tuple[torch.Tensor, torch.Tensor] | None = None  # the keys/values views last set
        self.in_use = False  # the current call reads views of the buffers: nothing moves until after_call
        self.pattern_memo: PatternMemo | None = None  # the last decoding_pattern

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self.is_sink = torch.zeros(0, dtype=torch.bool, device=self.device)

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Keep every key until the next ``crop`` (assisted decoding). Keywords (transformers 5.25's
        ``recurrent_states_to_keep``: how many recurrent states to record) concern recurrent layers only."""
        self.record_past = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        attention_kwargs = hand_to_kernel(self, kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.in_use = False  # a new call: the last one is done
        self._settle()
        self.attention_kwargs = {k: v for k, v in attention_kwargs.items() if k != LAYER_KWARG}
        count = key_states.shape[-2]
        self._append(key_states, value_states)
        self.seen += count
        self.new_tokens = self.pending = count
        self.key_positions, self.key_is_sink = self.positions, self.is_sink
        self.call_first, self.call_prefix = self.first_recent, self.sink_prefix
        self.in_use = True
        if self.rows_known:
            self._settle()
        return self.keys, self.values

    def after_call(self) -> None:
        """The attention call that read this layer's keys is done (the plug calls it): drop the unreachable keys."""
        self.in_use = False
        self._settle()

    def set_row_start(self, row_start: torch.Tensor | None) -> None:
        """Where each row's real tokens start (the plug tells the layer at the first call; sinks count from it)."""
        self.row_start, self.rows_known = row_start, True
        self._settle()  # classify this call's keys; what no later query reaches goes after the call

    def decoding_pattern(self, variant: PatternSource, layer_idx: int, kwargs: dict, row_start: torch.Tensor | None,
                         call: AttentionCall | None = None):
        """``variant``'s pattern for a decoding call of this layer with these attention kwargs and ``row_start``,
        evaluated at q_len = kv_len = 1 (for patterns that do not depend on the call's lengths, as the sinks the
        cache keeps) and reused across steps while the variant, ``row_start`` and the kwargs but
        :data:`PER_STEP_KWARGS` are the same objects: rebuilding it (predicates, token sets) cost more than the
        step's attention. ``call``: the call itself when the kernel asks (else a causal decoding call is made)."""
        return self._memo(variant, layer_idx, kwargs, row_start, call).pattern

    def _memo(self, variant: PatternSource, layer_idx: int, kwargs: dict, row_start: torch.Tensor | None,
              call: AttentionCall | None = None) -> PatternMemo:
        memo = self.pattern_memo
        if memo is not None and memo.variant is variant and memo.layer_idx == layer_idx and \
                memo.row_start is row_start and same_stable_kwargs(memo.kwargs, kwargs):
            return memo
        if call is None:
            call = decoding_call(layer_idx, kwargs, row_start)
        pattern = variant.pattern(call, 1, 1)
        self.pattern_memo = PatternMemo(variant, layer_idx, row_start, stable_kwargs(kwargs), pattern)
        return self.pattern_memo

    # -- sinks from the source's pattern ---------------------------------------------------------------------

    def _facts(self, kwargs: dict, row_start: torch.Tensor | None) -> tuple[int | None, int]:
        """(the last sink position, None if unknown; the first position past every global query) of the source's
        pattern, read once per pattern (host reads of the token sets' marks); asked twice per settle with the same
        kwargs object (the layer's own copy, which holds no reference to the layer), answered the second time without
        comparing the kwargs."""
        memo = self.pattern_memo
        if memo is None or memo.facts is None or memo.facts_for is not kwargs or memo.row_start is not row_start:
            memo = self._memo(self.source, self.layer_idx, kwargs, row_start)
            if memo.facts is None:
                tokens, rows = memo.pattern.sinks, memo.pattern.global_queries
                last = (tokens.last_position() if tokens else -1) if tokens is None or \
                    isinstance(tokens, TokenSet) else None
                memo.facts = last, rows.last_position() + 1 if rows else 0
            memo.facts_for = kwargs
        return memo.facts

    def _sink_horizon(self, kwargs: dict, row_start: torch.Tensor | None) -> int | None:
        return self._facts(kwargs, row_start)[0]

    def _sees_all_until(self, kwargs: dict, row_start: torch.Tensor | None) -> int:
        return self._facts(kwargs, row_start)[1]

    def _pattern_sinks(self, positions: torch.Tensor, kwargs: dict,
                       row_start: torch.Tensor | None) -> torch.Tensor | None:
        tokens = self._memo(self.source, self.layer_idx, kwargs, row_start).pattern.sinks
        if not tokens:
            return None
        rows = row_start.shape[0] if row_start is not None else 1
        batch = torch.arange(max(rows, _rows_of(tokens)), device=positions.device)[:, None]
        return tokens(batch, positions[None, :]).any(0)

    # -- buffers ---------------------------------------------------------------------------------------------

    def _held(self, like: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The buffers, rebuilt when keys/values were replaced from outside (beam reorder, batch selection, offload);
        the first ones shaped ``like`` the first new keys and values."""
        if self.buffers is None or self.views is None or self._keys is not self.views[0] or \
                self._values is not self.views[1]:
            held = [self.keys, self.values, self.positions, self.is_sink]
            if self.keys.dim() < 2 and like is not None:  # lazy_initialization's empty 1-D tensors
                held[:2] = [_tokens(part, 0, 0) for part in like]
            self._rebuild(held)
        return self.buffers

    def _rebuild(self, held: list[torch.Tensor], extra: int = 0) -> None:
        """Fresh buffers holding ``held`` (keys, values, positions, is_sink) with room for ``extra`` more tokens.
        The sink marks past ``hi`` are False (an appended token is no sink until classified: nothing to write)."""
        length = held[2].shape[0]
        capacity = length + extra + max(self.MIN_SLACK, (length + extra) // 4)
        buffers = []
        for part in held:
            buffer = part.new_empty(*part.shape[:-2], capacity, part.shape[-1]) if part.dim() > 1 else \
                part.new_zeros(capacity)
            if length:
                _tokens(buffer, 0, length).copy_(part)
            buffers.append(buffer)
        self.buffers, self.lo, self.hi = buffers, 0, length
        self._set_views()

    def _set_views(self) -> None:
        self._stale = False
        self._keys, self._values, self._positions, self._is_sink = (_tokens(b, self.lo, self.hi) for b in self.buffers)
        self.views = (self._keys, self._values)

    keys, values = _lazy_view("keys"), _lazy_view("values")
    positions, is_sink = _lazy_view("positions"), _lazy_view("is_sink")

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the new tokens at ``hi``: their keys, values and positions (their sink marks are False already)."""
        count, first = key_states.shape[-2], self.seen
        buffers = self._held(like=(key_states, value_states))
        if key_states.requires_grad or value_states.requires_grad or self._keys.requires_grad:  # no in-place writes
            new = [key_states, value_states, torch.arange(first, first + count, device=self.device),
                   torch.zeros(count, dtype=torch.bool, device=self.device)]  # classified at the next update
            self.buffers = [torch.cat([held, part], dim=-2 if part.dim() > 1 else 0)
                            for held, part in zip((self.keys, self.values, self.positions, self.is_sink), new,
                                                  strict=True)]
            self.lo, self.hi = 0, self.buffers[2].shape[0]
        else:
            if self.hi + count > buffers[2].shape[0]:
                self._rebuild([self.keys, self.values, self.positions, self.is_sink], extra=count)
            keys, values, positions, _ = self.buffers
            _tokens(keys, self.hi, self.hi + count).copy_(key_states)
            _tokens(values, self.hi, self.hi + count).copy_(value_states)
            if count == 1:
                positions[self.hi] = first
            else:
                positions[self.hi : self.hi + count] = torch.arange(first, first + count, device=self.device)
            self.hi += count
        self._set_views()

    def _settle(self) -> None:
        """Classify the keys of the last call (sinks, now that ``row_start`` is known) and drop the unreachable."""
        if self.pending:
            kwargs, recent = self.attention_kwargs, slice(self.positions.shape[0] - self.pending, None)
            horizon = self.sink_horizon(kwargs, self.row_start) if self.sink_horizon is not None else None
            past_horizon = horizon is not None and self.seen - self.pending > horizon  # e.g. a step past the sinks
            marked = None
            if self.sinks is not None and not past_horizon:
                marked = self.sinks(self.positions[recent], kwargs, self.row_start)
            if marked is not None:  # None: none of them (their marks stay False, as appended)
                marked = marked.to(self.device)
                self.is_sink[recent] = marked  # in place: the call in progress reads its keys' sinks (a view)
                if bool(marked.any()):
                    self.last_sink = max(self.last_sink, int(self.positions[recent][marked].max()))
            if self.sees_all_until is not None:
                self.complete_until = max(self.complete_until, int(self.sees_all_until(kwargs, self.row_start)))
            self.pending = 0
        if not self.record_past and not self.in_use:
            self._drop_unreachable()

    def _drop_unreachable(self) -> None:
        """Drop the non-sink keys no future query can reach (older than ``seen - reach``): ``lo`` moves on and the
        kept sinks are written just before the window (a copy of the sinks only)."""
        oldest = self.seen - self.reach
        if self.seen < self.complete_until or self.first_recent >= oldest:
            return
        self._held()
        prefix, cut = self.sink_prefix, self.sink_prefix + oldest - self.first_recent
        if self.first_recent > self.last_sink and not self.keys.requires_grad:
            self._drop_past_sinks(cut - prefix)
        else:
            self._drop_keeping_sinks(prefix, cut)
        self.first_recent = oldest
        if self.buffers[2].shape[0] > 2 * (self.hi - self.lo) + 2 * self.MIN_SLACK:  # after a long prefill
            self._rebuild([self.keys, self.values, self.positions, self.is_sink])

    def _drop_past_sinks(self, dropped: int) -> None:
        """Drop the ``dropped`` oldest window keys, none of them a sink (a decoding step): the first of the old sinks
        move into the dropped slots just after the others, so the sinks stay in front of the window in a rotated
        order. A step copies one row per buffer: no clone, no search."""
        prefix = self.sink_prefix
        moved = min(dropped, prefix)
        if moved:
            to = self.lo + max(dropped, prefix)
            for buffer in self.buffers:
                _tokens(buffer, to, to + moved).copy_(_tokens(buffer, self.lo, self.lo + moved))
        self.lo += dropped
        self._stale = True  # the next append narrows the buffers once for both

    def _drop_keeping_sinks(self, prefix: int, cut: int) -> None:
        """Drop the held keys ``prefix .. cut - 1`` but the sinks among them (or any drop under autograd): the old
        and the new sinks are gathered and written just before the keys from ``cut`` on."""
        parts = (self.keys, self.values, self.positions, self.is_sink)
        new_sinks = self.is_sink[prefix:cut].nonzero().squeeze(-1) + prefix
        kept = prefix + new_sinks.numel()
        if kept:
            index = torch.cat([torch.arange(prefix, device=new_sinks.device), new_sinks])
            sinks = [part.index_select(-2 if part.dim() > 1 else 0, index) for part in parts]
            if self.keys.requires_grad:  # autograd: fresh tensors, no write into what a graph saw
                rest = [_tokens(part, cut, part.shape[-2] if part.dim() > 1 else part.shape[0]) for part in parts]
                self._rebuild([torch.cat([a, b], dim=-2 if a.dim() > 1 else 0) for a, b in zip(sinks, rest,
                                                                                              strict=True)])
            else:
                start = self.lo + cut - kept
                for buffer, part in zip(self.buffers, sinks, strict=True):
                    _tokens(buffer, start, start + kept).copy_(part)
                self.lo = start
                self._set_views()
        else:
            self.lo += cut
            self._set_views()
        self.sink_prefix = kept

    def select(self, first_query: int, last_query: int) -> slice | torch.Tensor:
        """The keys of the current call that queries at positions ``first_query .. last_query`` can reach: the
        sinks and positions ``first_query - reach .. last_query``; a slice when contiguous, else indices."""
        prefix, first = self.call_prefix, self.call_first
        start = prefix + max(0, first_query - self.reach - first)
        stop = prefix + last_query - first + 1
        if start == prefix:
            return slice(0, stop)
        device = self.key_positions.device
        inner_sinks = self.key_is_sink[prefix:start].nonzero().squeeze(-1) + prefix
        return torch.cat([torch.arange(prefix, device=device), inner_sinks, torch.arange(start, stop, device=device)])

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (a negative count, as transformers calls it)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}.")
        count = -tokens_to_remove
        self.in_use = False
        if self.is_initialized and count:
            target = self.seen - count
            low = 0 if target < self.complete_until else max(0, target - self.reach)
            if self.first_recent > low:
                raise CacheRollbackError(
                    f"attention-zoo WindowedLayer cannot forget {count} tokens: it already dropped keys a later "
                    f"query needs (it keeps the last {self.reach} tokens and the sinks). Call "
                    "cache.activate_past_recording() before the forward you may roll back (assisted decoding does)."
                )
            self._held()
            old_hi, self.hi = self.hi, self.lo + self.sink_prefix + target - self.first_recent
            self.buffers[3][self.hi : old_hi] = False  # no sink marks past hi (see _rebuild)
            self._set_views()
            self.seen = target
            self.pending = max(0, self.pending - count)
        if self.is_initialized:
            self._settle()

    def reset(self) -> None:
        super().reset()
        self._clear()

    def nbytes(self) -> int:
        """Bytes of the keys it holds (its buffers' slack, at most a quarter more, not counted)."""
        return tensor_bytes([self.keys, self.values, self.positions, self.is_sink])



def _tokens(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Tokens ``start .. stop - 1`` of a buffer: the last-but-one dimension of keys/values, the only one of
    positions/sink marks (a view; ``narrow`` costs less than indexing, per decoding step)."""
    return x.narrow(-2 if x.dim() > 1 else 0, start, stop - start)


def pattern_cache_layer(variant: PatternSource, layer_idx: int) -> CacheLayerMixin:
    """The cache a variant's causal pattern needs (:meth:`Variant.cache_layer`'s default): with a finite ``reach``
    a :class:`WindowedLayer` keeping the pattern's sinks (global columns) and the last ``reach`` keys -- and every
    key while a global query (a row that sees everything) may still come; otherwise every key (``DynamicLayer``)."""
    pattern = variant.pattern(decoding_call(layer_idx, {}, None), 1, 1)
    if pattern is None or pattern.reach is None:
        return DynamicLayer()
    return WindowedLayer(pattern.reach, source=variant, layer_idx=layer_idx)


def decoding_call(layer_idx: int, kwargs: dict, row_start: torch.Tensor | None) -> AttentionCall:
    """A causal decoding call of one layer with these attention kwargs, as the cache asks a pattern for it."""
    return AttentionCall(causal=True, scaling=1.0, layer_idx=layer_idx, extra=kwargs, row_start=row_start,
                         decoding=True)


_MISSING = object()


def stable_kwargs(kwargs: dict) -> dict:
    """The attention kwargs but :data:`PER_STEP_KWARGS`."""
    return {key: value for key, value in kwargs.items() if key not in PER_STEP_KWARGS}


def same_stable_kwargs(old: dict | None, new: dict) -> bool:
    """Whether a call's attention kwargs ``new`` agree with ``old`` (kwargs as :func:`stable_kwargs` keeps them) on
    everything but :data:`PER_STEP_KWARGS`: the same objects (tensors by identity, other values by equality)."""
    if old is None:
        return False
    count = 0
    for key, now in new.items():
        if key in PER_STEP_KWARGS:
            continue
        count += 1
        before = old.get(key, _MISSING)
        if before is not now and (before is _MISSING or isinstance(now, torch.Tensor) or
                                  isinstance(before, torch.Tensor) or before != now):
            return False
    return count == len(old)


def _rows_of(tokens) -> int:
    marked = getattr(tokens, "marked", None)  # a TokenSet's per-row marks, or a rule of positions alone
    return marked.shape[0] if marked is not None else 1

