"""``based``: the Taylor feature map is the 2nd-order expansion of exp (φ(a)·φ(b) = 1 + s + s²/2) with the paper's
state size, the kernel equals its O(n²) definition written out, and it decodes like the full forward."""

from __future__ import annotations

import math

import pytest
import torch
from zoo.variants.based import BasedAttention, taylor_feature_count, taylor_features

from zoo import testing
from zoo.testing import run_variant


def test_taylor_features_expand_exp():
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(5, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    s = (a * b).sum(-1) / math.sqrt(16)
    torch.testing.assert_close((taylor_features(a) * taylor_features(b)).sum(-1), 1 + s + s**2 / 2)
    assert taylor_features(a).shape[-1] == taylor_feature_count(16) == 1 + 16 + 136


def test_kernel_is_the_normalized_taylor_attention_written_out():
    variant = BasedAttention(feature_dim=4, short_conv=0, chunk_size=8)
    q, k, v, mask = testing.make_inputs(n=21, padding="right", head_dim=6, dtype=torch.float64)
    call = testing.make_call(True, mask, head_dim=6, variant=variant, dtype=torch.float64)
    out = run_variant(variant, q, k, v, call)
    w = call.weights
    fq = torch.einsum("bhnd,hfd->bhnf", q, w.feature_q.double())
    fk = torch.einsum("bhnd,hfd->bhnf", k, w.feature_k.double())
    scores = 1 + (s := fq @ fk.transpose(-1, -2) / 2) + s**2 / 2  # f = 4: s = q·k / √4
    allowed = torch.ones(21, 21, dtype=torch.bool).tril() & mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, 0)
    want = (scores @ v) / scores.sum(-1, keepdim=True).clamp_min(1e-300)
    want = want.masked_fill(~mask[:, None, :, None], 0)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("short_conv", [0, 4])
def test_decodes_like_the_full_forward(short_conv):
    testing.assert_decodes_like_the_full_forward("based", short_conv=short_conv)


def test_weights_are_per_head_projections():
    weights = testing.make_weights(BasedAttention())
    assert weights.feature_q.shape == weights.feature_k.shape == (testing.HEADS, 16, testing.HEAD_DIM)
    assert weights.conv is not None and weights.conv.k.weight.shape == (testing.HEADS * testing.HEAD_DIM, 1, 4)
