"""Helpers for testing an attention variant beyond the contract suite (:mod:`zoo.contract` is built on them).

A plugin author's own tests use the same inputs (:func:`make_inputs`, :func:`make_call`, :func:`make_variant`), dense
:func:`reference`, comparisons (:func:`assert_matches_reference`), allocation probe (:class:`LargestAllocation`),
reload and learned-weight checks as the suite.

Modules: :mod:`~zoo.testing.inputs` (variants, q/k/v, calls, weights, tiny models), :mod:`~zoo.testing.comparison`
(the reference, errors, padding and autocast checks), :mod:`~zoo.testing.memory` (the allocation probe),
:mod:`~zoo.testing.persistence` (reload checks), :mod:`~zoo.testing.decoding` (generation checks) and
:mod:`~zoo.testing.contract` (the suite). Every name is importable from ``zoo.testing`` as before.

Example and the full list: docs/notes/internals.md#testing
"""

from zoo.ops import allowed_mask, softmax_attention
from zoo.plug.dispatch import run_variant
from zoo.testing.comparison import (
    APPROXIMATE_AUTOCAST_FACTOR,  # noqa: F401  (importable, not in __all__)
    AUTOCAST_TOLERANCE,  # noqa: F401  (importable, not in __all__)
    PAD_AMOUNT,  # noqa: F401  (importable, not in __all__)
    assert_invariant_to_padding_amount,
    assert_matches_reference,
    assert_runs_under_autocast,  # noqa: F401  (importable, not in __all__)
    padding_amount_difference,
    real_rows,
    relative_error,
)
from zoo.testing.decoding import (
    DECODE_NEW_TOKENS,  # noqa: F401  (importable, not in __all__)
    DECODE_PROMPT_LENGTH,  # noqa: F401  (importable, not in __all__)
    assert_cache_bytes_bounded,
    assert_decodes_like_the_full_forward,
    causal_lm,
    declares_bounded_cache,
    decode_prompts,
    decoding_refusal,
    greedy,
)
from zoo.testing.inputs import (
    ATOL,
    BATCH,
    DECODER_FAMILIES,  # noqa: F401  (importable, not in __all__)
    HEAD_DIM,
    HEADS,
    MEMORY_CHECK_LENGTH,
    REAL_LENGTH,
    N,
    declares_weights,
    make_call,
    make_inputs,
    make_variant,
    make_weights,
    model_inputs,
    modes,
    tiny_model_config,
)
from zoo.testing.memory import (
    QUADRATIC_FRACTION,  # noqa: F401  (importable, not in __all__)
    LargestAllocation,
    assert_memory_below_quadratic,
    declares_subquadratic_memory,
    largest_allocation,
)
from zoo.testing.persistence import (
    assert_reloads_identically,
    assert_weights_train_and_reload,
)
from zoo.variant import reference

__all__ = [
    "ATOL", "BATCH", "HEADS", "HEAD_DIM", "MEMORY_CHECK_LENGTH", "N", "REAL_LENGTH", "LargestAllocation",
    "allowed_mask", "assert_cache_bytes_bounded", "assert_decodes_like_the_full_forward",
    "assert_invariant_to_padding_amount", "assert_matches_reference", "assert_memory_below_quadratic",
    "assert_reloads_identically", "assert_weights_train_and_reload", "causal_lm",
    "declares_bounded_cache", "declares_subquadratic_memory", "declares_weights", "decode_prompts",
    "decoding_refusal", "greedy", "largest_allocation", "make_call", "make_inputs", "make_variant", "make_weights",
    "model_inputs", "modes", "padding_amount_difference", "real_rows", "reference", "relative_error", "run_variant",
    "softmax_attention",
    "tiny_model_config",
]  # fmt: skip
