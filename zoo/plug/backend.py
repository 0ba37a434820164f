"""Which kernel runs an exact pattern variant's call: its own chunked kernel or FlexAttention
(:mod:`zoo.ops.backends.flex`).

Set with :func:`attention_backend` (a context manager):

* ``"auto"`` (default): Flex only where it was measured to win: on CUDA for the variants in :data:`CUDA_MEASURED`,
  on CPU for inference from the length in :data:`CPU_CROSSOVER` (both empty: see README, "Backends"). A call Flex
  cannot run (attention dropout, decoding steps, learned per-layer weights...) takes the chunked kernel, with one
  log line per reason.
* ``"flex"``: every call of an exact pattern variant through Flex; a call it cannot run raises, naming why (tests
  and benchmarks). A call compiled Flex would run eagerly (past dynamo's recompile limit: O(n²) scores) raises
  under ``"flex"`` and takes the chunked kernel, with one log line, under ``"auto"`` (:func:`after_flex_failure`).
  Variants without a pattern (dense, approximate) run their own kernel under every backend, except the
  content-chosen ``moba`` and ``nsa``, whose kernels read the same setting and build their Flex block masks from the
  blocks they choose (:mod:`zoo.ops.backends.flex_blocks`).
* ``"chunked"``: the variant's own kernel (``Variant.attend``) always.

The setting and the lists of what was measured live in :mod:`zoo.ops.backends.choice` (the kernels below the plug
read them); this module re-exports them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch

from zoo.call import AttentionCall
from zoo.ops.backends.choice import (  # the setting lives in the ops layer: content-chosen kernels read it too
    BACKENDS,
    CPU_CROSSOVER,
    CUDA_MEASURED,
    SETTINGS,
    FlexUnavailableError,
    compiled,
    flex_reason,
    measured,
)
from zoo.pattern import Pattern
from zoo.variant import Variant

logger = logging.getLogger(__name__)
__all__ = ["BACKENDS", "CPU_CROSSOVER", "CUDA_MEASURED", "FlexUnavailableError", "attention_backend", "compiled",
           "flex_pattern", "unsupported_reason"]


@contextlib.contextmanager
def attention_backend(backend: str, compiled: bool = True) -> Iterator[None]:
    """Force ``"flex"``, ``"chunked"`` or ``"auto"`` for the exact pattern variants and the content-chosen ``moba``
    and ``nsa`` inside the block.

    ``compiled=False`` runs FlexAttention's eager reference (O(n²) memory; it ignores the block mask): for tests only.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}.")
    saved = dict(SETTINGS)
    SETTINGS.update(backend=backend, compiled=compiled)
    try:
        yield
    finally:
        SETTINGS.update(saved)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> str | None:
    """Why Flex cannot run this call of an exact pattern variant (None: it can)."""
    if q.shape[-2] == k.shape[-2] and call.weights is not None:
        return "the variant has learned per-layer weights its pattern does not describe"
    return flex_reason(q, k, v, call)


def flex_pattern(
    variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall
) -> Pattern | None:
    """The pattern to run on Flex for this call under the current backend, or None for the variant's own kernel
    (forced ``"flex"`` raises when Flex cannot run the call). The pattern is built once, here."""
    backend = SETTINGS["backend"]
    if backend == "chunked" or (backend == "auto" and not measured(variant.name, q)):
        return None
    if not variant.exact:  # an approximate variant is no restricted softmax
        return None
    pattern = variant.pattern(call, q.shape[-2], k.shape[-2])
    if pattern is None:  # dense: SDPA is the fast kernel
        return None
    reason = unsupported_reason(q, k, v, call)
    if reason is None and not pattern.runs_on_flex:
        reason = "its pattern() returns a bare predicate without hints (plugin API 1)"
    if reason is None:
        return pattern
    if backend == "flex":
        raise FlexUnavailableError(
            f"attention_backend('flex') was forced, but attention-zoo variant {variant.name!r} cannot run this "
            f"call on FlexAttention: {reason}. Use attention_backend('auto') to fall back to its kernel."
        )
    _log_fallback_once(variant.name, reason)
    return None


def after_flex_failure(variant: Variant, error: Exception) -> None:
    """Flex could not run a call it was picked for (``zoo.ops.backends.flex.FlexRecompileLimitError``): under a forced
    ``"flex"`` raise, naming why; otherwise log once and let the variant's chunked kernel run it."""
    if SETTINGS["backend"] == "flex":
        raise FlexUnavailableError(
            f"attention_backend('flex') was forced, but attention-zoo variant {variant.name!r} cannot run this call "
            f"on FlexAttention: {error}. Raise torch._dynamo.config.recompile_limit above the number of distinct "
            "patterns and length buckets, or use attention_backend('auto') to fall back to its kernel."
        ) from error
    _log_fallback_once(variant.name, str(error))


@functools.cache
def _log_fallback_once(variant: str, reason: str) -> None:
    logger.info("attention-zoo variant %r runs its chunked kernel instead of FlexAttention: %s.", variant, reason)
