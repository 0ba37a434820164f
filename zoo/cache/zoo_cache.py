"""The transformers ``Cache`` of a zoo model (:class:`ZooCache`: one layer per decoder layer, chosen by the variant) and
its byte count (:func:`cache_nbytes`)."""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import Cache

from zoo.cache.protocol import tensor_bytes


class ZooCache(Cache):
    """One cache layer per decoder layer, each chosen by the model's variant (:meth:`Variant.cache_layer`)."""

    def __init__(self, variant: Any, config: Any) -> None:
        text_config = config.get_text_config(decoder=True)
        layers = [variant.cache_layer(index, text_config) for index in range(text_config.num_hidden_layers)]
        super().__init__(layers=layers)
        self.variant_name = variant.name


def cache_nbytes(cache: Cache) -> int:
    """Bytes a transformers cache holds: our layers count their state, other layers their tensor attributes."""
    total = 0
    for layer in getattr(cache, "layers", []):
        nbytes = getattr(layer, "nbytes", None)
        total += nbytes() if callable(nbytes) else tensor_bytes(vars(layer).values())
    return total
