"""attention-zoo: a plugin-based zoo of long-context attention variants for Hugging Face transformers.

``import zoo`` registers the ``attention_zoo`` attention implementation with transformers, so models
saved with a variant load back with it.
"""

from zoo.cache import cache_nbytes
from zoo.convert import from_longformer
from zoo.generation import make_cache
from zoo.hf import IMPLEMENTATION, configure, install, variant_for, variant_spec
from zoo.longify import longify
from zoo.ops.flex import attention_backend
from zoo.registry import (
    BrokenVariantError,
    UnknownVariantError,
    VariantConflictError,
    get_variant_class,
    list_variants,
    register_variant,
    unregister_variant,
)
from zoo.variant import AttentionCall, LayerWeights, Param, Variant, VariantParameterError

install()

__version__ = "0.1.0"

__all__ = [
    "LayerWeights",
    "IMPLEMENTATION",
    "AttentionCall",
    "BrokenVariantError",
    "Param",
    "UnknownVariantError",
    "Variant",
    "VariantConflictError",
    "VariantParameterError",
    "attention_backend",
    "cache_nbytes",
    "configure",
    "from_longformer",
    "get_variant_class",
    "list_variants",
    "longify",
    "make_cache",
    "register_variant",
    "unregister_variant",
    "variant_for",
    "variant_spec",
]
