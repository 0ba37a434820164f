"""Attention dropout inside the chunked CPU kernels (zoo.ops.dropout) of longformer, bigbird and sparse_transformer:
the mask statistics (keep rate 1 − p, scaling 1 / (1 − p)), output and gradients equal to the dense reference given
the same mask (many small chunks, so masks come from many per-chunk generators), reproducibility under
``torch.manual_seed``, eval untouched, padding, and no probabilities kept (allocation probe at n = 4096)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zoo.ops.dropout as dropout_ops
from zoo.ops import allowed_mask, limits, safe_softmax
from zoo.ops.dropout import Dropout, dropped_probabilities
from zoo.plug.dispatch import run_variant
from zoo.testing import LargestAllocation, make_call, make_inputs, make_variant, modes, real_rows

VARIANTS = ["longformer", "bigbird", "sparse_transformer"]
P = 0.3


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows: every call draws its masks from many per-chunk generators."""
    monkeypatch.setattr("zoo.ops.limits.DROPOUT_CHUNK_ELEMENTS", 700)
    monkeypatch.setattr("zoo.ops.limits.GATHER_CHUNK_ELEMENTS", 300)


def dense_probabilities(variant, q, k, call) -> torch.Tensor:
    """Softmax restricted to the variant's pattern, causality and padding: (B, H, n, n)."""
    pattern = variant.pattern(call, q.shape[-2], k.shape[-2])
    allowed = allowed_mask(call, pattern, q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])
    scores = torch.matmul(q, k.transpose(-1, -2)) * call.scaling
    return safe_softmax(scores.masked_fill(~allowed, float("-inf")))


def probe(variant, q, k, call) -> torch.Tensor:
    """The dropped probabilities the next call from the current RNG state uses."""
    return dropped_probabilities(lambda values: run_variant(variant, q, k, values, call), *q.shape[:2], k.shape[-2])


def padded_rows_zeroed(x, mask):
    return x.masked_fill(~mask[:, None, :, None], 0.0)


@pytest.mark.parametrize("name", VARIANTS)
def test_output_and_gradients_equal_the_dense_reference_given_the_mask(name, small_chunks):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, v, mask = make_inputs(3)
        call = make_call(causal, mask, dropout=P, training=True)
        torch.manual_seed(11)
        dropped = probe(variant, q, k, call)
        keep = dropped != 0
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = run_variant(variant, *leaves, call)  # same RNG state as the probe: same masks
        grad_out = torch.randn_like(out)
        (out * grad_out).sum().backward()

        ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        probs = dense_probabilities(variant, *ref_leaves[:2], call)
        ref = padded_rows_zeroed(torch.matmul(probs * keep * Dropout(P).keep_scale, ref_leaves[2]), mask)
        (ref * grad_out).sum().backward()

        torch.testing.assert_close(real_rows(out, mask), real_rows(ref, mask), atol=1e-5, rtol=1e-4)
        for got, want, which in zip(leaves, ref_leaves, "qkv", strict=True):
            torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-4, msg=lambda m, w=which: f"d{w}: {m}")


@pytest.mark.parametrize("name", VARIANTS)
def test_keep_rate_is_one_minus_p_and_kept_probabilities_are_scaled(name, small_chunks):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, _, mask = make_inputs(4)
        call = make_call(causal, mask, dropout=P, training=True)
        probs = dense_probabilities(variant, q, k, call)
        torch.manual_seed(5)
        dropped = probe(variant, q, k, call)
        attended = (probs > 0) & mask[:, None, :, None]
        kept = dropped[attended] != 0
        assert abs(kept.float().mean().item() - (1 - P)) < 0.03, kept.float().mean()
        # every attended probability is either dropped or scaled by exactly 1 / (1 - p)
        torch.testing.assert_close(dropped[attended][kept], probs[attended][kept] * Dropout(P).keep_scale,
                                   atol=1e-6, rtol=1e-5)
        # with v = 1 each output is (sum of kept probabilities) / (1 - p): 1 on average
        torch.manual_seed(6)
        ones = run_variant(variant, q, k, torch.ones_like(q), call)
        assert abs(real_rows(ones, mask).mean().item() - 1) < 0.05


def test_keep_masks_have_the_dropout_distribution():
    stream = Dropout(0.1, seed=123)
    first, second = (stream.child(chunk).keep_mask((1000, 1000)) for chunk in (0, 1))
    sigma = (0.1 * 0.9 / first.numel()) ** 0.5
    assert abs(first.float().mean().item() - 0.9) < 5 * sigma
    # chunks draw independent masks: they agree as often as two independent ones would (p² + (1 − p)²)
    assert abs((first == second).float().mean().item() - 0.82) < 5 * sigma * 2
    # neighbours within a mask are independent too (no structure from packing four decisions per draw)
    agree = (first[:, :-1] == first[:, 1:]).float().mean().item()
    assert abs(agree - 0.82) < 5 * sigma * 2
    assert torch.equal(stream.child(0).keep_mask((1000, 1000)), first)  # the backward redraws the same mask
    assert abs((1 - 1 / stream.keep_scale) - 0.1) <= 2**-17  # p rounded to 16 bits, scaled by its exact inverse
    assert Dropout(1.0, seed=1).keep_scale == 0.0 and not Dropout(1.0, seed=1).keep_mask((100,)).any()
    buffer = np.full(2_000_000, 7.0, np.float32)  # a reused buffer holds the same mask, whatever it held before
    assert torch.equal(stream.child(1).keep_mask((1000, 1000), buffer), second)


@pytest.mark.parametrize(("queries", "keys"), [(0, 5), (3, 0)])
def test_no_query_or_no_key_gives_zeros(queries, keys):
    q, k = torch.randn(1, 2, queries, 8), torch.randn(1, 2, keys, 8)
    out, lse = dropout_ops.dropout_forward(q, k, k, None, 0.3, Dropout(0.1, seed=3))
    grads = dropout_ops.dropout_backward(torch.ones_like(out), q, k, k, out, lse, None, 0.3, Dropout(0.1, seed=3))
    assert out.shape == (1, 2, queries, 8) and not out.any() and not lse.any()
    assert all(not g.any() for g in grads)


@pytest.mark.parametrize("name", VARIANTS)
def test_reproducible_under_manual_seed(name):
    variant = make_variant(name)
    q, k, v, mask = make_inputs(5)
    call = make_call(modes(name)[0], mask, dropout=P, training=True)

    def step(seed):
        torch.manual_seed(seed)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = run_variant(variant, *leaves, call)
        out.square().sum().backward()
        return [out, *(x.grad for x in leaves)]

    first, again, other = step(1), step(1), step(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.allclose(real_rows(first[0], mask), real_rows(other[0], mask))


@pytest.mark.parametrize("name", VARIANTS)
def test_eval_is_unaffected_and_draws_no_seed(name):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, v, mask = make_inputs(6)
        plain = run_variant(variant, q, k, v, make_call(causal, mask))
        state = torch.random.get_rng_state()
        for training, p in ((False, P), (True, 0.0)):
            out = run_variant(variant, q, k, v, make_call(causal, mask, dropout=p, training=training))
            assert torch.equal(out, plain)
        assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("name", VARIANTS)
def test_padding_never_changes_real_outputs_with_dropout(name, small_chunks):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, v, mask = make_inputs(7)
        call = make_call(causal, mask, dropout=P, training=True)
        torch.manual_seed(3)
        out = run_variant(variant, q, k, v, call)
        pad = ~mask[:, None, :, None]
        noisy = [x.masked_fill(pad, 0.0) + torch.randn_like(x) * 100 * pad for x in (q, k, v)]
        torch.manual_seed(3)
        out_noisy = run_variant(variant, *noisy, call)
        torch.testing.assert_close(real_rows(out_noisy, mask), real_rows(out, mask), atol=1e-5, rtol=1e-4)
        assert (out[pad.expand_as(out)] == 0).all()


def largest_tensor(variant, n: int, causal: bool, p: float) -> int:
    q, k, v, _ = make_inputs(n=n, padding=None, batch=1, heads=1)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, n - n // 16 :] = False
    leaves = [x.requires_grad_() for x in (q, k, v)]
    with LargestAllocation() as allocations:
        run_variant(variant, *leaves, make_call(causal, mask, dropout=p, training=True)).sum().backward()
    return allocations.largest


@pytest.mark.parametrize("name", VARIANTS)
def test_dropout_keeps_no_probabilities(name):
    """n = 4096 (one head): no tensor of n²/8 elements, and nothing larger than the kernels' chunk buffers or
    what the same call without dropout allocates."""
    n = 4096
    variant = make_variant(name, **{"longformer": {"window": 256}, "bigbird": {"block_size": 64},
                                    "sparse_transformer": {"stride": 64}}[name])
    for causal in modes(name):
        with_dropout, without = largest_tensor(variant, n, causal, 0.1), largest_tensor(variant, n, causal, 0.0)
        assert with_dropout < n * n // 8
        row_chunk = limits.DROPOUT_ROW_CHUNK_FACTOR * limits.DROPOUT_CHUNK_ELEMENTS
        assert with_dropout <= max(without, row_chunk), (with_dropout, without)
