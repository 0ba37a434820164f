"""The allocation probe: the largest tensor a call allocates (forward and backward), and the check that a variant
declaring memory below O(n²) allocates no n x n tensor.
"""

from __future__ import annotations

import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zoo.plug.dispatch import run_variant
from zoo.testing.inputs import MEMORY_CHECK_LENGTH, make_call, make_inputs, modes
from zoo.variant import Variant

QUADRATIC_FRACTION = 8  # a tensor of n²/8 elements or more counts as quadratic


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage (in elements, ``largest``) and the longest dimension (``longest_dim``) of any
    tensor an op produces, forward and backward: tests use it to show a sub-quadratic kernel never allocates
    anything of size n x n (or pads a short input up to a window).

    ``with LargestAllocation() as probe: ...; probe.largest``."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.longest_dim = 0
        self.largest_op = ""  # the aten op that produced the largest tensor, and that tensor's shape and dtype
        self.largest_shape: tuple[int, ...] = ()
        self.largest_dtype: torch.dtype | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                size = t.untyped_storage().nbytes() // t.element_size()
                if size > self.largest:
                    self.largest, self.largest_op = size, str(func)
                    self.largest_shape, self.largest_dtype = tuple(t.shape), t.dtype
                self.longest_dim = max(self.longest_dim, *t.shape, 0)
        return out

    def describe(self) -> str:
        """What allocated the largest tensor: ``aten.op -> (shape) dtype``."""
        return f"{self.largest_op} -> {tuple(self.largest_shape)} {self.largest_dtype}"


def declares_subquadratic_memory(cls: type[Variant] | Variant) -> bool:
    """False when ``memory_complexity`` mentions n² anywhere (``n²``, ``n^2``, ``n**2``, ``n·n``, ``n x n``)."""
    return re.search(r"n\s*(²|\^\s*2|\*\*\s*2|[·*×x]\s*n\b)", cls.memory_complexity) is None


def largest_allocation(
    variant: Variant, n: int = MEMORY_CHECK_LENGTH, causal: bool = False, padded: bool = True, head_dim: int = 16,
    batch: int = 1, heads: int = 1, probe: LargestAllocation | None = None, **call_fields,
) -> int:
    """Elements of the largest tensor one forward and backward of ``variant`` produces at length ``n``
    (q/k/v (batch, heads, n, head_dim); ``padded``: the last n/16 tokens of the last row are padding;
    ``call_fields``: other :class:`AttentionCall` fields, e.g. ``extra={"global_attention_mask": ...}``). Pass a
    ``probe`` to read what allocated it (:meth:`LargestAllocation.describe`)."""
    q, k, v, _ = make_inputs(n=n, padding=None, batch=batch, heads=heads, head_dim=head_dim)
    mask = None
    if padded:
        mask = torch.ones(batch, n, dtype=torch.bool)
        mask[-1, n - n // 16 :] = False
    leaves = [x.requires_grad_() for x in (q, k, v)]
    call = make_call(causal, mask, head_dim=head_dim, variant=variant, heads=heads, **call_fields)
    probe = probe if probe is not None else LargestAllocation()
    with probe:
        out = run_variant(variant, *leaves, call)
        out.sum().backward()
    return probe.largest


def assert_memory_below_quadratic(variant: Variant, n: int = MEMORY_CHECK_LENGTH, **kwargs) -> None:
    """A variant that declares sub-quadratic memory allocates no tensor of n²/8 elements or more at length n,
    forward and backward, in every mode it supports (batch 1, one head: the limit is per (batch, head))."""
    batch, heads = kwargs.get("batch", 1), kwargs.get("heads", 1)
    limit = n * n // QUADRATIC_FRACTION * batch * heads
    for causal in modes(type(variant)):
        probe = LargestAllocation()
        largest = largest_allocation(variant, n, causal=causal, probe=probe, **kwargs)
        if largest >= limit:
            raise AssertionError(
                f"attention-zoo variant {variant.name!r} declares memory {variant.memory_complexity} but allocated a "
                f"tensor of {largest} elements (>= n²/{QUADRATIC_FRACTION} per head = {limit} at n = {n}, batch "
                f"{batch}, {heads} head(s), {'causal' if causal else 'bidirectional'}, forward and backward): "
                f"{probe.describe()}. Find the op that builds it (an n x n score or mask, or a tensor that grows "
                "faster than the keys each query reads) and compute it in blocks; if the variant really needs "
                "O(n²) memory, declare it."
            )
