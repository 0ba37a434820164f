"""attention-zoo: a plugin-based zoo of long-context attention variants for Hugging Face transformers.

``import zoo`` registers the ``attention_zoo`` attention implementation with transformers, so models
saved with a variant load back with it. What a plugin may use (plugin API `PLUGIN_API_VERSION`, changes in
CHANGELOG.md): the names below, `zoo.call`, `zoo.pattern`, `zoo.cache`, the kernels of `zoo.ops`,
`zoo.testing` and ``pytest --pyargs zoo.contract``.
"""

from zoo.compat import check_transformers

check_transformers()  # before anything else: a transformers below the floor would run silently wrong

from zoo.cache import cache_nbytes
from zoo.call import AttentionCall
from zoo.convert import from_longformer, longify
from zoo.plug.backend import attention_backend
from zoo.plug.generation import make_cache
from zoo.plug.install import configure, install
from zoo.plug.spec import IMPLEMENTATION, UnsupportedModelError, variant_for, variant_spec
from zoo.registry import (
    BrokenVariantError,
    UnknownVariantError,
    VariantConflictError,
    get_variant_class,
    list_variants,
    register_variant,
    unregister_variant,
)
from zoo.variant import PLUGIN_API_VERSION, LayerWeights, Param, Variant, VariantParameterError

install()

__version__ = "0.3.0"

__all__ = [
    "IMPLEMENTATION",
    "PLUGIN_API_VERSION",
    "AttentionCall",
    "BrokenVariantError",
    "LayerWeights",
    "Param",
    "UnknownVariantError",
    "UnsupportedModelError",
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
