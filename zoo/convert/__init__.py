"""Checkpoint conversion: transformers Longformer checkpoints onto the zoo (:mod:`zoo.convert.longformer`) and
position tables tiled to a longer context (:mod:`zoo.convert.longify`)."""

from zoo.convert.longformer import from_longformer, longformer_global_attention_mask
from zoo.convert.longify import check_max_length, longify, position_capacity

__all__ = ["check_max_length", "from_longformer", "longformer_global_attention_mask", "longify", "position_capacity"]
