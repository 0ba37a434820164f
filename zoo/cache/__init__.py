"""Decoding caches chosen by the variant: a transformers ``Cache`` whose layer objects are what
:meth:`zoo.variant.Variant.cache_layer` returns, one per decoder layer (:class:`ZooCache`). Shared layer kinds:
:class:`WindowedLayer` (the sinks and the last ``reach`` keys), :class:`GrowingLayer` (every key, appended in amortized
O(new tokens)), :class:`RecurrentLayer` (running sums, no keys), :class:`HeadSplitLayer` (every key of some KV heads,
the sinks and recent keys of the others), :class:`WindowStateLayer` (a ring of recent keys beside a recurrent state)
and :class:`BudgetedLayer` (sinks, recent keys and a budget of keys a KV policy scores, per row and KV head, for
pretrained models). Each speaks the cache-layer protocol
(:class:`ZooCacheLayer`): ``update`` hands the layer to the kernel through the attention kwargs (:data:`LAYER_KWARG`);
layers report every token seen, so :meth:`~ZooCacheLayer.key_columns` picks the mask columns of the keys kept. Keys
are cached after positions are applied, so a kept key keeps its token's phase.

Costs, the transformers calling convention relied on and the versions checked: docs/notes/internals.md#cache
"""

from zoo.cache.budgeted import BudgetedLayer, PositionsExhaustedError
from zoo.cache.growing import GrowingLayer
from zoo.cache.head_split import HeadSplitLayer
from zoo.cache.kernel_state import KernelStateLayer
from zoo.cache.policies import DEFAULT_POLICY, POLICIES, Policy, as_policy
from zoo.cache.protocol import (
    LAYER_KWARG,
    PER_STEP_KWARGS,
    BatchMapped,
    CacheRollbackError,
    ZooCacheLayer,
    hand_to_kernel,
    tensor_bytes,
)
from zoo.cache.recurrent import RecurrentLayer
from zoo.cache.window_state import WindowStateLayer
from zoo.cache.windowed import (
    PatternMemo,
    PatternSource,
    SinkPredicate,
    WindowedLayer,
    decoding_call,
    pattern_cache_layer,
    same_stable_kwargs,
    stable_kwargs,
)
from zoo.cache.zoo_cache import ZooCache, cache_nbytes

__all__ = [
    "DEFAULT_POLICY", "LAYER_KWARG", "PER_STEP_KWARGS", "POLICIES", "BatchMapped", "BudgetedLayer",
    "CacheRollbackError", "GrowingLayer", "HeadSplitLayer", "KernelStateLayer", "PatternMemo", "PatternSource",
    "Policy",
    "PositionsExhaustedError", "RecurrentLayer", "SinkPredicate", "WindowStateLayer", "WindowedLayer", "ZooCache",
    "ZooCacheLayer",
    "as_policy", "cache_nbytes", "decoding_call", "hand_to_kernel", "pattern_cache_layer", "same_stable_kwargs",
    "stable_kwargs", "tensor_bytes",
]
