"""flash-linear-attention's triton kernels (fla 0.6.0, ``pip install "attention-zoo[fla]"``) as an optional CUDA
backend of :func:`zoo.ops.delta_rule.delta_rule`, :func:`zoo.ops.gated_linear.gated_linear_attention` and the
selected branch of ``nsa`` (:func:`zoo.ops.nsa.selected_branch`).

Those entry points ask :func:`fla_kernel` first; it gives fla's function only when the call can run there with the
same semantics, else None and the zoo's own chunked kernel runs:

* CUDA tensors only. fla is imported lazily (``importlib``), after that check: a CPU run never imports it (with fla
  and triton on a CPU machine, transformers' own pure-torch gated-delta-rule fallback is routed to fla's triton
  kernels and crashes, "0 active drivers").
* q, k, v in bf16 or fp16 (one dtype). fla's delta rule refuses fp32, and its other kernels take fp32 operands to
  triton's ``tl.dot`` at TF32 precision: fp32 and fp64 calls stay on the zoo's kernels, which accumulate in fp32.
* Head dims fla takes (even, at most 256); ``$ATTENTION_ZOO_FLA=0`` turns the backend off; an fla that fails to
  import is logged once and never tried again in the process.

The math is the same on both sides (read in fla 0.6.0's sources): ``chunk_delta_rule`` / ``chunk_gated_delta_rule``
compute S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, o_t = scale · S_tᵀ q_t with ``g`` = log α_t per token
(not cumulated: fla cumulates per chunk itself), β already activated (no in-kernel sigmoid) and q, k as given (the
variants normalize them: no in-kernel L2 norm); ``chunk_gla`` (log α per key channel) and ``chunk_simple_gla``
(per head) the gated linear recurrence. The adapters move (B, H, n, d) to fla's (B, n, H, d) and back, pass the
scale and the initial state (B, H, d_k, d_v) fp32, ask for the final state (fp32, same layout) and return the output
in v's dtype. fla picks its own chunk size (the zoo's ``chunk_size`` changes rounding only). β is passed in q's dtype
(fla's tested convention), log α in fp32 (as fla's layers pass it). Gradients flow to q, k, v, β, log α and the
initial state through fla's own backward.

NSA: only fla's selected-block kernel (``ParallelNSAFunction``: q of a KV group's heads against the blocks listed per
query and KV head, causal inside, one softmax over their union) has the zoo's semantics; the zoo chooses the blocks
itself (fla's ``parallel_nsa`` compresses by mean pooling with compression block = selection block and no stride,
and runs its window on flash-attn). It takes a call with a KV group of 16, 32, ... query heads (its tiles hold a
group), selection blocks of a power of two ≥ 16, no padding inside the span, as many queries as keys and no
attention dropout. fla's MoBA (``parallel_moba``) needs the flash-attn package throughout, so it is not a backend.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable

import torch

ENV = "ATTENTION_ZOO_FLA"  # "0": never use fla
DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
KERNELS = {  # the zoo's name -> (fla module, function)
    "delta_rule": ("fla.ops.delta_rule", "chunk_delta_rule"),
    "gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "gla": ("fla.ops.gla", "chunk_gla"),
    "simple_gla": ("fla.ops.simple_gla", "chunk_simple_gla"),
    "nsa_selected": ("fla.ops.nsa.parallel", "ParallelNSAFunction"),  # an autograd.Function: its .apply
}

logger = logging.getLogger(__name__)
_loaded: dict[str, Callable | None] = {}


def enabled() -> bool:
    """False when ``$ATTENTION_ZOO_FLA`` is ``0`` (read at each call)."""
    return os.environ.get(ENV, "1").strip() != "0"


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a call on these tensors may run on fla: CUDA, bf16/fp16 in one dtype, head dims fla takes, switch on.
    Looks at the tensors only: imports nothing."""
    return (q.is_cuda and q.dtype in DTYPES and q.dtype == k.dtype == v.dtype and q.shape[-2] > 0 and enabled()
            and all(d <= MAX_HEAD_DIM and d % 2 == 0 for d in (k.shape[-1], v.shape[-1])))


def load(name: str) -> Callable | None:
    """fla's function for the zoo kernel ``name`` (a key of :data:`KERNELS`), None when fla does not import."""
    if name not in _loaded:
        module, function = KERNELS[name]
        try:
            _loaded[name] = getattr(importlib.import_module(module), function)
        except Exception as error:  # no fla: silently the zoo's kernels; an fla that fails to import: said once
            if not (isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "fla"):
                logger.warning("flash-linear-attention: %s.%s does not import (%s: %s); the zoo's kernels run "
                               "instead", module, function, type(error).__name__, error)
            _loaded[name] = None
    return _loaded[name]


def fla_kernel(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable | None:
    """fla's function for the zoo kernel ``name`` when this call may run on it (:func:`applies`), else None."""
    return load(name) if applies(q, k, v) else None


@functools.cache
def installed() -> bool:
    """Whether a package ``fla`` can be found (found, not imported)."""
    return importlib.util.find_spec("fla") is not None


def model_dtype_inputs(dtype: torch.dtype, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The variants prepare q, k, v in fp32 (convolution, normalization); where fla would take the call, they go
    back to the model's ``dtype`` (bf16/fp16), the precision fla's kernels are built for. Else (CPU: always)
    unchanged, so the zoo's kernels see exactly what they saw without fla."""
    if q.is_cuda and dtype in DTYPES and enabled() and installed():
        return q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v


def heads_second(x: torch.Tensor) -> torch.Tensor:
    """(B, H, n, ...) <-> (B, n, H, ...)."""
    return x.transpose(1, 2)


def fla_delta_rule(kernel: Callable, q, k, v, beta, log_decay, scale: float, initial_state):
    """:func:`zoo.ops.delta_rule.delta_rule`'s call (same arguments, same results) run by fla's ``kernel``
    (``chunk_delta_rule``, or ``chunk_gated_delta_rule`` when ``log_decay`` is given)."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        args = dict(q=heads_second(q), k=heads_second(k), v=heads_second(v), beta=heads_second(beta.to(q.dtype)),
                    scale=float(scale), initial_state=None if initial_state is None else initial_state.float(),
                    output_final_state=True, use_qk_l2norm_in_kernel=False)
        if log_decay is not None:
            args["g"] = heads_second(log_decay.float())
        out, final = kernel(**args)
    return heads_second(out).to(v.dtype), final.float()


def fla_gated_linear(kernel: Callable, q, k, v, log_decay, scale: float, initial_state):
    """:func:`zoo.ops.gated_linear.gated_linear_attention`'s call run by fla's ``kernel`` (``chunk_gla`` for a
    per-channel log α (B, H, n, d_k), ``chunk_simple_gla`` for one per head (B, H, n))."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        out, final = kernel(q=heads_second(q), k=heads_second(k), v=heads_second(v),
                            g=heads_second(log_decay.float()), scale=float(scale),
                            initial_state=None if initial_state is None else initial_state.float(),
                            output_final_state=True)
    return heads_second(out).to(v.dtype), final.float()


def power_of_two(n: int, least: int) -> bool:
    return n >= least and n & (n - 1) == 0


def fla_nsa_kernel(q, k, v, call, size: int, groups: int):
    """fla's selected-block kernel when this ``nsa`` selected-branch call may run on it (module docstring), else None.
    q (B, H, Q, D); k, v (B, H, n, D) with each KV head repeated ``groups`` times."""
    if not (power_of_two(groups, 16) and power_of_two(size, 16) and call.padding_mask is None
            and q.shape[-2] == k.shape[-2] and call.effective_dropout == 0):
        return None
    return fla_kernel("nsa_selected", q, k, v)


def fla_nsa_selected(kernel, q, k, v, blocks, chosen, size: int, scale: float) -> torch.Tensor:
    """The selected branch by fla: q (B, H, n, D); k, v (B, H_kv, n, D); blocks, chosen (B, H_kv, n, R), a KV group's
    choice. fla reads (B, n, H_kv, S) block numbers, S a power of two, -1 for a slot not chosen."""
    slots = 1 << max(0, blocks.shape[-1] - 1).bit_length()
    numbers = torch.where(chosen, blocks, -1)
    numbers = torch.nn.functional.pad(numbers, (0, slots - blocks.shape[-1]), value=-1)
    with torch.autocast(device_type=q.device.type, enabled=False):
        out = kernel.apply(heads_second(q), heads_second(k), heads_second(v),
                           heads_second(numbers).to(torch.int32).contiguous(), slots, size, float(scale), None)
    return heads_second(out).to(v.dtype)
