"""What the plug and a zoo cache layer say to each other around an attention call (:class:`ZooCacheLayer`), and the
parts every layer kind shares: handing itself to the kernel (:func:`hand_to_kernel`), beam reorder for per-row state
(:class:`BatchMapped`), byte counts (:func:`tensor_bytes`).

A layer's ``update`` puts the layer into the attention kwargs (:data:`LAYER_KWARG`); the plug
(:mod:`zoo.plug.dispatch`) takes it out and, through the methods below only, learns which mask columns and positions
the keys have and tells the layer where rows start and when the call is done. A plugin's own layer takes part by
subclassing :class:`ZooCacheLayer` beside a transformers layer class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

LAYER_KWARG = "attention_zoo_cache_layer"
# Attention kwargs transformers renews at every step and that no pattern reads (a pattern sees positions through its
# predicate's arguments): a decoding pattern is reused while the other kwargs stay the same (WindowedLayer).
PER_STEP_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", LAYER_KWARG})


class CacheRollbackError(RuntimeError):
    """A cache was asked to forget tokens it can no longer restore (``crop``)."""


class ZooCacheLayer:
    """The cache-layer protocol: what the plug reads from a zoo cache layer and tells it at every attention call.

    Read: ``seen`` (tokens seen, what ``get_seq_length`` reports), ``new_tokens`` (the current call's),
    ``key_positions`` (K,) (the positions of the keys handed to the kernel), :meth:`key_columns` (their padding mask
    columns). Told, in this order: :meth:`set_row_start` at a call whose row starts the layer does not know yet
    (``rows_known`` False), else :meth:`kept_keys_padding` gives the keys' padding; :meth:`after_call` once the kernel
    is done. Every hook defaults to nothing; mask sizes cover every token seen (the kernel picks its columns).
    """

    seen: int
    new_tokens: int
    key_positions: torch.Tensor | None
    rows_known = False  # the layer holds each row's start from an earlier call (then the plug reads row_start)
    row_start: torch.Tensor | None = None

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

    def set_row_start(self, row_start: torch.Tensor | None) -> None:
        """Where each row's real tokens start (B,), or None (no padding), told at a call while ``rows_known`` is
        False (before :meth:`key_columns`)."""

    def kept_keys_padding(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The padding mask over the keys handed to the kernel at a call while ``rows_known``, or None when all of
        them are real tokens: then padding changes nothing (the queries are the last keys) and a decoding step runs
        without a mask. Only the kept keys' columns are read: no work in the length of the context per step."""
        if attention_mask is None:
            return None
        real = self.key_columns(attention_mask).bool()
        if torch.compiler.is_compiling() or not bool(real.all()):
            return real
        return None

    def after_call(self) -> None:
        """The attention call that read this layer's keys is done."""


def hand_to_kernel(layer: ZooCacheLayer, update_kwargs: dict) -> dict:
    """Put ``layer`` into the attention kwargs that ``cache.update`` received; returns those kwargs."""
    attention_kwargs = update_kwargs.get("kwargs")
    if not isinstance(attention_kwargs, dict):
        raise TypeError(
            f"attention-zoo's {type(layer).__name__} needs the attention kwargs in cache.update(k, v, layer_idx, "
            "kwargs=...) to hand its state to the kernel, and this model's attention does not pass them. Decode "
            "this model with use_cache=False, or a transformers DynamicCache (which keeps every key)."
        )
    if not isinstance(layer, ZooCacheLayer):
        raise TypeError(
            f"attention-zoo: cache layer {type(layer).__name__} hands itself to the kernel but is no "
            "zoo.cache.ZooCacheLayer; subclass it (beside the transformers layer class) so the plug can tell it "
            "where rows start and when the call is done."
        )
    attention_kwargs[LAYER_KWARG] = layer
    return attention_kwargs


class BatchMapped:
    """Beam reorder and batch selection for layers whose per-row tensors ``_map_state(fn)`` maps (batch first)."""

    def _map_state(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_state(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda x: x[indices])


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct tensor storages among ``tensors`` (None and non-tensors are skipped)."""
    seen, total = set(), 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel() and tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total

