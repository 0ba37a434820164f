"""Shared kernels in zoo.ops that variants rely on for speed: running heads in groups must change nothing."""

from __future__ import annotations

import pytest
import torch

from zoo.plug.dispatch import run_variant
from zoo.registry import get_variant_class
from zoo.testing import make_call


@pytest.mark.parametrize("name", ["linear", "performer"])
@pytest.mark.parametrize("causal", [False, True])
def test_head_groups_give_the_same_output_and_gradients(name, causal, monkeypatch):
    variant = get_variant_class(name)()
    mask = torch.ones(2, 90, dtype=torch.bool)
    mask[0, 70:] = False
    mask[1, :15] = False
    results = []
    for elements in (2**30, 1):  # all heads at once; one head per group
        monkeypatch.setattr("zoo.ops.dense.HEAD_GROUP_ELEMENTS", elements)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 90, 16, generator=gen).requires_grad_() for _ in range(3))
        out = run_variant(variant, q, k, v, make_call(causal, mask))
        out.pow(2).sum().backward()
        results.append([out, q.grad, k.grad, v.grad])
    for whole, grouped in zip(*results, strict=True):
        torch.testing.assert_close(grouped, whole, atol=1e-6, rtol=1e-5)
