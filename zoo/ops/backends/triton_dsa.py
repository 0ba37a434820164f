"""Whether DSA's attention over the selected keys runs on the zoo's Triton kernels
(:mod:`zoo.ops.backends.triton_dsa_kernels`, ``pip install "attention-zoo[triton]"``; a CUDA build of torch brings
triton already) rather than gathering copies of the keys (:func:`zoo.ops.dsa.token_attention` asks first).

It does on CUDA tensors only, in fp32, bf16 or fp16 (one dtype), head dims up to 256, without attention dropout (the
kernels have none), with ``$ATTENTION_ZOO_TRITON`` not ``0``. The kernels' module is loaded by name on the first such
call (as :mod:`zoo.ops.backends.fla` loads fla): a CPU run never imports triton, and the tests import the module
themselves under ``TRITON_INTERPRET=1`` (triton picks the interpreter when a kernel is defined). A triton that fails
to import is logged once and not tried again.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable

import torch

from zoo.call import AttentionCall

ENV = "ATTENTION_ZOO_TRITON"  # "0": never use the Triton kernels
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
KERNELS = "zoo.ops.backends.triton_dsa_kernels"

logger = logging.getLogger(__name__)


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> bool:
    """Whether this call may run on the Triton kernels (module docstring). Looks at the tensors only."""
    return (q.is_cuda and q.dtype in DTYPES and q.dtype == k.dtype == v.dtype and call.effective_dropout == 0
            and max(q.shape[-1], v.shape[-1]) <= MAX_HEAD_DIM and os.environ.get(ENV, "1").strip() != "0")


@functools.cache
def load() -> Callable | None:
    """The kernels' entry point (:func:`zoo.ops.backends.triton_dsa_kernels.topk_attention`), None without triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.import_module(KERNELS).topk_attention
    except Exception as error:  # a triton that does not import here: said once, the zoo's kernel runs
        logger.warning("triton: %s does not import (%s: %s); dsa gathers its keys instead", KERNELS,
                       type(error).__name__, error)
        return None


def triton_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> Callable | None:
    """The Triton entry point when this call may run on it, else None (the zoo's kernel runs)."""
    return load() if applies(q, k, v, call) else None
