"""The backend setting the plug's ``zoo.attention_backend`` writes (:mod:`zoo.plug.backend`) and the kernels read, kept
in the ops layer so that a content-chosen variant (``moba``, ``nsa``), whose blocks are known only inside its kernel,
can take FlexAttention under the same switch as the pattern variants (:mod:`zoo.ops.backends.flex_blocks`).

* ``"auto"``: Flex only where measured: CUDA for the names in :data:`CUDA_MEASURED`, CPU inference from the length
  in :data:`CPU_CROSSOVER` (both empty: nothing has been measured to win yet).
* ``"flex"``: Flex for every call it can run; any other call raises :class:`FlexUnavailableError`, naming why.
* ``"chunked"``: the zoo's own kernels.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

import torch

from zoo.call import AttentionCall
from zoo.ops.backends.flex import DTYPES, FlexRecompileLimitError

BACKENDS = ("auto", "flex", "chunked")
# CPU, eval forward: the length from which compiled Flex beat the variant's chunked kernel (measured, see README).
# A variant not listed keeps its chunked kernel on CPU under "auto".
CPU_CROSSOVER: dict[str, int] = {}
# CUDA: the variants whose Flex path compiled and beat their chunked kernel in scripts/gpu_check.sh (none measured yet).
CUDA_MEASURED: frozenset[str] = frozenset()
SETTINGS = {"backend": "auto", "compiled": True}

logger = logging.getLogger(__name__)


class FlexUnavailableError(ValueError):
    """``attention_backend("flex")`` was forced for a call FlexAttention cannot run."""


def compiled() -> bool:
    """Whether Flex runs compiled (False only inside ``attention_backend(..., compiled=False)``)."""
    return SETTINGS["compiled"]


def measured(name: str, q: torch.Tensor) -> bool:
    """Whether ``"auto"`` may pick Flex for variant ``name`` at q's device and length: only where it was measured."""
    if q.is_cuda:
        return name in CUDA_MEASURED
    return q.shape[-2] >= CPU_CROSSOVER.get(name, math.inf)


def flex_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> str | None:
    """Why FlexAttention cannot run this call (None: it can), whatever the variant."""
    if q.shape[-2] != k.shape[-2]:
        return "decoding step (fewer queries than keys): the variant's cache path runs"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (Flex takes fp32, bf16 and fp16)"
    if call.training and call.dropout > 0:
        return f"attention dropout p={call.dropout:g} (FlexAttention has none, pytorch#141784)"
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return "a gradient is needed and FlexAttention has no backward on CPU"
    return None


def content_flex(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> bool:
    """Whether a content-chosen variant's kernel runs this call on Flex under the current backend (forced ``"flex"``
    raises when Flex cannot run it; ``"auto"`` logs once and keeps the chunked kernel)."""
    backend = SETTINGS["backend"]
    if backend == "chunked" or (backend == "auto" and not measured(name, q)):
        return False
    reason = flex_reason(q, k, v, call)
    if reason is None:
        return True
    if backend == "flex":
        raise FlexUnavailableError(
            f"attention_backend('flex') was forced, but attention-zoo variant {name!r} cannot run this call on "
            f"FlexAttention: {reason}. Use attention_backend('auto') to fall back to its kernel."
        )
    _log_once(name, reason)
    return False


def on_flex(name: str, run: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """``run()`` (a content-chosen kernel on Flex), or None where compiled Flex would recompile past dynamo's limit
    (and run eagerly, n x n scores): under ``"auto"`` logged once, the caller's chunked kernel runs; forced ``"flex"``
    raises, naming why."""
    try:
        return run()
    except FlexRecompileLimitError as error:
        if SETTINGS["backend"] == "flex":
            raise FlexUnavailableError(
                f"attention_backend('flex') was forced, but attention-zoo variant {name!r} cannot run this call on "
                f"FlexAttention: {error}. Raise torch._dynamo.config.recompile_limit."
            ) from error
        _log_once(name, str(error))
        return None


@functools.cache
def _log_once(name: str, reason: str) -> None:
    logger.info("attention-zoo variant %r runs its chunked kernel instead of FlexAttention: %s.", name, reason)
