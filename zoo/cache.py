"""Decoding caches chosen by the variant: a transformers ``Cache`` whose layer objects are what
:meth:`zoo.variant.Variant.cache_layer` returns, one per decoder layer. Shared layer kinds: :class:`WindowedLayer`
(the sinks and the last ``reach`` keys), :class:`GrowingLayer` (every key, appended in amortized O(new tokens)),
:class:`RecurrentLayer` (running sums, no keys) and :class:`BudgetedLayer` (sinks, recent keys and a budget of scored
keys per row and KV head, for pretrained models). ``update`` hands the layer to the kernel through the attention
kwargs (:data:`LAYER_KWARG`); layers report every token seen, so :meth:`key_columns` picks the mask columns of the
keys kept. Keys are cached after positions are applied, so a kept key keeps its token's phase.

Costs, the transformers calling convention relied on and the versions checked: docs/notes/internals.md#cache
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from zoo.call import AttentionCall
from zoo.ops import kept
from zoo.pattern import TokenSet

LAYER_KWARG = "attention_zoo_cache_layer"
# Attention kwargs transformers renews at every step and that no pattern reads (a pattern sees positions through its
# predicate's arguments): a decoding pattern is reused while the other kwargs stay the same (WindowedLayer).
PER_STEP_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", LAYER_KWARG})

# (positions (K,), attention kwargs, row_start (B,) | None) -> (K,) bool: keys kept forever (any row's sink)
SinkPredicate = Callable[[torch.Tensor, dict, "torch.Tensor | None"], "torch.Tensor | None"]


class CacheRollbackError(RuntimeError):
    """A cache was asked to forget tokens it can no longer restore (``crop``)."""


def hand_to_kernel(layer: CacheLayerMixin, update_kwargs: dict) -> dict:
    """Put ``layer`` into the attention kwargs that ``cache.update`` received; returns those kwargs."""
    attention_kwargs = update_kwargs.get("kwargs")
    if not isinstance(attention_kwargs, dict):
        raise TypeError(
            f"attention-zoo's {type(layer).__name__} needs the attention kwargs in cache.update(k, v, layer_idx, "
            "kwargs=...) to hand its state to the kernel, and this model's attention does not pass them. Decode "
            "this model with use_cache=False, or a transformers DynamicCache (which keeps every key)."
        )
    attention_kwargs[LAYER_KWARG] = layer
    return attention_kwargs


class _SeenTokens:
    """What both layer kinds share: tokens seen, mask sizes over every token seen, mask columns of the keys."""

    seen: int
    key_positions: torch.Tensor | None

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def query_positions(self) -> torch.Tensor:
        """Positions of the tokens of the current call (the last ones seen)."""
        return self.key_positions[-self.new_tokens :]

    def key_columns(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The columns of a (batch, tokens seen) padding mask that belong to the keys the kernel receives."""
        if attention_mask is None:
            return None
        if attention_mask.shape[-1] != self.seen:
            raise ValueError(
                f"attention-zoo cache: the padding mask covers {attention_mask.shape[-1]} tokens but the cache has "
                f"seen {self.seen}. Pass an attention_mask over every token so far (as generate does)."
            )
        return attention_mask.index_select(-1, self.key_positions.to(attention_mask.device))


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


class WindowedLayer(_SeenTokens, DynamicLayer):
    """Keys a windowed pattern can still reach: every sink (global) key and the last ``reach`` keys.

    A future query at position p may see keys p - reach .. p and the sinks, so the layer drops the non-sink keys
    older than ``seen - reach`` -- once the attention call is done (:meth:`after_call`, from the plug; else at the next
    update), and once the call has told it where each row's real tokens start (``row_start``, set by the plug: left
    padding moves the first real tokens).
    ``sinks(positions, attention_kwargs, row_start) -> (len,) bool`` (or None: none of them) marks keys kept
    forever (e.g. StreamingLLM's first tokens, Longformer's global tokens, union over the batch);
    ``sees_all_until(attention_kwargs, row_start) -> int``: every key is kept while fewer tokens were seen (a global
    query still to come attends to all earlier keys); ``sink_horizon(attention_kwargs, row_start) -> int | None``: no
    sink lies past this position (None: unknown), so a step past it asks ``sinks`` nothing.

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
                 sink_horizon: Callable[[dict, torch.Tensor | None], int | None] | None = None) -> None:
        super().__init__()
        self.reach = int(reach)
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
        self.pattern_memo: tuple | None = None  # (variant, layer_idx, row_start, kwargs, pattern): decoding_pattern

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

    def decoding_pattern(self, variant: Any, layer_idx: int, kwargs: dict, row_start: torch.Tensor | None,
                         call: AttentionCall | None = None):
        """``variant``'s pattern for a decoding call of this layer with these attention kwargs and ``row_start``,
        evaluated at q_len = kv_len = 1 (for patterns that do not depend on the call's lengths, as the sinks the
        cache keeps) and reused across steps while the variant, ``row_start`` and the kwargs but
        :data:`PER_STEP_KWARGS` are the same objects: rebuilding it (predicates, token sets) cost more than the
        step's attention. ``call``: the call itself when the kernel asks (else a causal decoding call is made)."""
        memo = self.pattern_memo
        if memo is not None and memo[0] is variant and memo[1] == layer_idx and memo[2] is row_start and \
                same_stable_kwargs(memo[3], kwargs):
            return memo[4]
        if call is None:
            call = _decoding_call(layer_idx, kwargs, row_start)
        pattern = variant.pattern(call, 1, 1)
        self.pattern_memo = (variant, layer_idx, row_start, stable_kwargs(kwargs), pattern)
        return pattern

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


def pattern_cache_layer(variant: Any, layer_idx: int) -> CacheLayerMixin:
    """The cache a variant's causal pattern needs (:meth:`Variant.cache_layer`'s default): with a finite ``reach``
    a :class:`WindowedLayer` keeping the pattern's sinks (global columns) and the last ``reach`` keys -- and every
    key while a global query (a row that sees everything) may still come; otherwise every key (``DynamicLayer``)."""
    pattern = variant.pattern(_decoding_call(layer_idx, {}, None), 1, 1)
    if pattern is None or pattern.reach is None:
        return DynamicLayer()

    layer: WindowedLayer | None = None
    read: list = [None, None, None, None]  # the pattern last read, what was read from it, the kwargs and row_start

    def pattern_at(kwargs: dict, row_start: torch.Tensor | None):
        return layer.decoding_pattern(variant, layer_idx, kwargs, row_start)

    def facts(kwargs: dict, row_start: torch.Tensor | None) -> tuple[int | None, int]:
        """(the last sink position, None if unknown; the first position past every global query), read once per
        pattern (host reads of the token sets' marks); asked twice per settle with the same kwargs object (the
        layer's own copy, which holds no reference to the layer), answered the second time without a lookup."""
        if kwargs is read[2] and row_start is read[3]:
            return read[1]
        pattern = pattern_at(kwargs, row_start)
        if read[0] is not pattern:
            tokens, rows = pattern.sinks, pattern.global_queries
            last = (tokens.last_position() if tokens else -1) if tokens is None or isinstance(tokens, TokenSet) \
                else None
            read[:2] = pattern, (last, rows.last_position() + 1 if rows else 0)
        read[2:] = kwargs, row_start
        return read[1]

    def sinks(positions: torch.Tensor, kwargs: dict, row_start: torch.Tensor | None) -> torch.Tensor | None:
        tokens = pattern_at(kwargs, row_start).sinks
        if not tokens:
            return None
        rows = row_start.shape[0] if row_start is not None else 1
        batch = torch.arange(max(rows, _rows_of(tokens)), device=positions.device)[:, None]
        return tokens(batch, positions[None, :]).any(0)

    layer = WindowedLayer(pattern.reach, sinks, sees_all_until=lambda kwargs, row_start: facts(kwargs, row_start)[1],
                          sink_horizon=lambda kwargs, row_start: facts(kwargs, row_start)[0])
    return layer


def _decoding_call(layer_idx: int, kwargs: dict, row_start: torch.Tensor | None):
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


class _BatchMapped:
    """Beam reorder and batch selection for layers whose per-row tensors ``_map_state(fn)`` maps (batch first)."""

    def _map_state(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_state(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda x: x[indices])


class RecurrentLayer(_BatchMapped, _SeenTokens, CacheLayerMixin):
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

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise CacheRollbackError(
            "attention-zoo RecurrentLayer cannot forget tokens: its state is a running sum over every token seen "
            "(linear attention), which cannot be rolled back. Assisted decoding and other rollbacks need a variant "
            "that keeps keys (e.g. longformer, xformers with a window, sdpa)."
        )

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



POLICIES = ("sinks_recent", "knorm", "tova", "h2o", "snapkv", "expected_attention")


class PositionsExhaustedError(ValueError):
    """A budgeted cache was asked to go past the model's ``max_position_embeddings``."""


class BudgetedLayer(_BatchMapped, _SeenTokens, DynamicLayer):
    """A bounded cache for a model trained with full attention: per batch row and KV head, the first ``sinks`` real
    tokens of the row, the last ``recent`` tokens and the ``tokens - sinks - recent`` other keys that score highest
    under ``policy`` (:data:`POLICIES`, scores in :mod:`zoo.ops.kept`). Once it holds more than ``tokens + slack`` keys
    it evicts down to ``tokens`` (``slack=0``: after every call); padding keys go first, sinks and recent keys never.
    Each (row, KV head) keeps its own tokens, the same count everywhere, so the tensors stay rectangular.

    Held state, per (row, KV head): ``keys``/``values`` (B, Hk, K, d), ``pos`` (B, Hk, K) token positions (ascending),
    ``real`` (not padding) and ``mass`` (H2O's accumulated attention); and the last ``window`` queries (``queries``,
    ``query_real``) for the policies that score from recent queries. The kernel (the ``budget`` variant) reads them
    through ``call.cache`` and reports back with :meth:`observe`. ``key_positions`` (what the plug hands the kernel)
    are row 0 / head 0's: the positions of every row and head while nothing was evicted, and of the current call's
    tokens (the last ones) always. Keys keep their rotary phase (nothing is re-rotated); past ``max_positions`` tokens
    :meth:`update` refuses (:class:`PositionsExhaustedError`).
    """

    is_sliding = False

    def __init__(self, tokens: int, sinks: int = 4, recent: int = 64, policy: str = "tova", slack: int = 0,
                 window: int = 32, max_positions: int | None = None) -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"BudgetedLayer: unknown policy {policy!r}; use one of {', '.join(POLICIES)}.")
        if tokens < sinks + recent or min(sinks, recent, slack) < 0 or window < 1:
            raise ValueError(f"BudgetedLayer: need tokens >= sinks + recent and non-negative sizes, got tokens="
                             f"{tokens}, sinks={sinks}, recent={recent}, slack={slack}, window={window}.")
        self.tokens, self.sinks, self.recent, self.slack = int(tokens), int(sinks), int(recent), int(slack)
        self.policy, self.max_positions = policy, max_positions
        self.window = 1 if policy == "tova" else int(window)
        self._clear()

    @property
    def accumulates(self) -> bool:
        """The policy needs every query's attention (H2O): the kernel computes it at every call."""
        return self.policy == "h2o"

    @property
    def records_queries(self) -> bool:
        return self.policy in ("tova", "snapkv", "expected_attention")

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
        if self.policy == "sinks_recent":
            return kept.recency_scores(self.pos)
        if self.policy == "knorm":
            return kept.knorm_scores(self.keys)
        if self.policy == "h2o":
            return self.mass
        window = self.queries.shape[-2]
        query_pos = torch.arange(self.seen - window, self.seen, device=self.device)
        if self.policy == "expected_attention":
            return kept.expected_attention_scores(self.queries, self.query_real, self.keys, self.values, self.real,
                                                  self.scaling)
        score = kept.tova_scores if self.policy == "tova" else kept.snapkv_scores
        return score(self.queries, query_pos, self.query_real, self.keys, self.pos, self.real, self.scaling)

    def protected(self) -> torch.Tensor:
        """(B, Hk, K) bool: the sinks (the first ``sinks`` real tokens of each row) and the last ``recent`` tokens."""
        start = self.row_start[:, None, None] if self.row_start is not None else 0
        sinks = (self.pos >= start) & (self.pos < start + self.sinks)
        return sinks | (self.pos >= self.seen - self.recent)

    def evict(self) -> None:
        """Keep ``tokens`` keys per (row, KV head): the protected ones, then the highest scores; padding last."""
        priority = self.scores().masked_fill(self.protected(), float("inf")).masked_fill(~self.real, float("-inf"))
        keep = priority.topk(min(self.tokens, priority.shape[-1]), dim=-1, sorted=False).indices.sort(dim=-1).values
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


class ZooCache(Cache):
    """One cache layer per decoder layer, each chosen by the model's variant (:meth:`Variant.cache_layer`)."""

    def __init__(self, variant: Any, config: Any) -> None:
        text_config = config.get_text_config(decoder=True)
        layers = [variant.cache_layer(index, text_config) for index in range(text_config.num_hidden_layers)]
        super().__init__(layers=layers)
        self.variant_name = variant.name


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct tensor storages among ``tensors`` (None and non-tensors are skipped)."""
    seen, total = set(), 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel() and tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def cache_nbytes(cache: Cache) -> int:
    """Bytes a transformers cache holds: our layers count their state, other layers their tensor attributes."""
    total = 0
    for layer in getattr(cache, "layers", []):
        nbytes = getattr(layer, "nbytes", None)
        total += nbytes() if callable(nbytes) else tensor_bytes(vars(layer).values())
    return total
