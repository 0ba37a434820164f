"""One attention call as the plug describes it to a kernel (`AttentionCall`): the bottom of the variant contract,
below patterns, kernels (`zoo.ops`), caches and `zoo.variant.Variant`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionCall:
    """Everything about one attention call except q/k/v, set once by the plug so kernels need not re-derive it.

    q, k, v reach the kernel as (batch, heads, n, head_dim), grouped-query heads already expanded (a variant with
    ``grouped_kv`` gets k/v with the model's key/value heads).

    Attributes:
        causal: the model is causal (a decoder): keys after a query are never seen.
        scaling: the softmax scale the model asks for (usually head_dim ** -0.5).
        padding_mask: (batch, kv_len) bool, True for real tokens, or None when nothing is padded.
        dropout: the attention dropout probability the model asks for (see `effective_dropout`).
        training: the module is in training mode.
        layer_idx: the index of the attention layer.
        extra: model keyword arguments that reached the attention function (for example ``global_attention_mask``
            for Longformer).
        state: a dict persisted in the model config, for variants that must save what they drew.
        cache: the variant's own cache layer (what `Variant.cache_layer` returned for this layer) when the model
            decodes with a zoo cache, else None. With a cache, q holds the new tokens only and k/v hold what the layer
            returned from ``update`` (see `zoo.cache`); ``padding_mask`` then covers those keys.
        weights: this layer's module from `Variant.make_module` (None for variants without learned weights); read
            it with `Variant.layer_weights`.
        positions: (kv_len,) long, the token position of each key (None: 0 .. kv_len - 1; a windowed cache hands
            over sinks and the recent keys).
        decoding: the queries are the newest tokens over a cache holding earlier ones (the queries are always the
            last ``q_len`` keys).
        row_start: (batch,) long, each row's first real token (left padding); None when every row starts at 0.
        cross_attention: the keys come from another sequence (an encoder); ``padding_mask`` covers those keys.
        recomputed: a training forward recomputed during the backward (activation/gradient checkpointing): state
            that counts training calls must not advance, and the call must compute exactly what the original forward
            did.
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
        """The token positions of the keys.

        Returns:
            (kv_len,) long.
        """
        return self.positions if self.positions is not None else torch.arange(kv_len, device=device)

    def query_positions(self, q_len: int, kv_len: int, device=None) -> torch.Tensor:
        """The token positions of the queries: those of the last ``q_len`` keys.

        Returns:
            (q_len,) long.
        """
        return self.key_positions(kv_len, device)[kv_len - q_len :]
