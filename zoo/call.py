"""One attention call as the plug describes it to a kernel (:class:`AttentionCall`): the bottom of the variant contract,
below patterns, kernels (:mod:`zoo.ops`), caches and :class:`zoo.variant.Variant`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionCall:
    """Everything about one attention call except q/k/v.

    ``padding_mask`` is ``(batch, kv_len)`` bool, True for real tokens, or None when nothing is padded.
    ``extra`` carries model keyword arguments that reached the attention function (for example
    ``global_attention_mask`` for Longformer). ``state`` is a dict persisted in the model config, for
    variants that must save what they drew (Performer's redraw counters).

    ``cache`` is the variant's own cache layer (what :meth:`Variant.cache_layer` returned for this layer) when
    the model decodes with a zoo cache, else None. With a cache, q holds the new tokens only and k/v hold
    what the layer returned from ``update`` (see :mod:`zoo.cache`); ``padding_mask`` then covers those keys.

    ``weights`` is this layer's module from :meth:`Variant.make_module` (None for variants without learned
    weights); read it with :meth:`Variant.layer_weights`.

    Set once by the plug so kernels need not re-derive them: ``positions`` (kv_len,) long, the token position of each
    key (None: 0 .. kv_len - 1; a windowed cache hands over sinks and the recent keys); ``decoding``: the queries are
    the newest tokens over a cache holding earlier ones (the queries are always the last ``q_len`` keys);
    ``row_start`` (batch,) long: each row's first real token (left padding), None when every row starts at 0;
    ``cross_attention``: the keys come from another sequence (an encoder), ``padding_mask`` covers those keys;
    ``recomputed``: a training forward recomputed during the backward (activation/gradient checkpointing): state that
    counts training calls must not advance, and the call must compute exactly what the original forward did.
    """

    causal: bool
    scaling: float
    padding_mask: torch.Tensor | None = None
    dropout: float = 0.0
    training: bool = False
    layer_idx: int = 0
    extra: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    cache: Any = None
    weights: torch.nn.Module | None = None
    positions: torch.Tensor | None = None
    decoding: bool = False
    row_start: torch.Tensor | None = None
    cross_attention: bool = False
    recomputed: bool = False

    @property
    def effective_dropout(self) -> float:
        """The attention dropout probability this call applies: ``dropout`` in training, else 0."""
        return self.dropout if self.training else 0.0

    def key_positions(self, kv_len: int, device=None) -> torch.Tensor:
        """(kv_len,) token positions of the keys."""
        return self.positions if self.positions is not None else torch.arange(kv_len, device=device)

    def query_positions(self, q_len: int, kv_len: int, device=None) -> torch.Tensor:
        """(q_len,) token positions of the queries: the last ``q_len`` keys."""
        return self.key_positions(kv_len, device)[kv_len - q_len :]
