"""``gla`` and its kernel zoo.ops.gated_linear: chunked == recurrence (fp64, per-channel and per-head decay, lengths
that are not chunk multiples, an initial state), gradients, strong decays without overflow, the three decay settings
(RetNet's γ_h exactly), padding, and prefill-then-decode == one full forward in Llama (GQA)."""

from __future__ import annotations

import pytest
import torch
from zoo.variants.gla import GLAAttention

import zoo
from zoo import testing
from zoo.modules import retnet_log_decay
from zoo.ops.gated_linear import gated_linear_attention
from zoo.ops.gated_linear.naive import gated_linear_recurrence
from zoo.testing import run_variant


def inputs(n: int, per_channel: bool, batch: int = 2, heads: int = 2, d_k: int = 6, d_v: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, n, d_k, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, heads, n, d_v, generator=gen, dtype=torch.float64)
    shape = (batch, heads, n, d_k) if per_channel else (batch, heads, n)
    log_decay = -torch.rand(*shape, generator=gen, dtype=torch.float64)
    state = torch.randn(batch, heads, d_k, d_v, generator=gen, dtype=torch.float64)
    return q, k, v, log_decay, state


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("n, chunk", [(1, 16), (23, 16), (37, 8), (50, None)])
def test_chunked_form_equals_the_recurrence(per_channel, n, chunk):
    q, k, v, log_decay, state = inputs(n, per_channel)
    for initial in (None, state):
        out, final = gated_linear_attention(q, k, v, log_decay, 0.4, chunk, initial)
        want, want_final = gated_linear_recurrence(q, k, v, log_decay, 0.4, initial)
        torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
        torch.testing.assert_close(final, want_final, atol=1e-6, rtol=0)


@pytest.mark.parametrize("per_channel", [True, False])
def test_strong_decay_does_not_overflow(per_channel):
    """log α = −60 per token: exp(+60·C) would overflow a factorized form; every exponent here is ≤ 0."""
    q, k, v, log_decay, _ = inputs(40, per_channel)
    out, _ = gated_linear_attention(q.float(), k.float(), v.float(), 60 * log_decay.float(), 1.0, 16)
    want, _ = gated_linear_recurrence(q, k, v, 60 * log_decay, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("per_channel", [True, False])
def test_gradients_equal_the_recurrences(per_channel):
    tensors = inputs(19, per_channel, batch=1)
    grads = []
    for fn in (lambda *a: gated_linear_attention(*a[:4], 0.5, 8, a[4]), lambda *a: gated_linear_recurrence(
            *a[:4], 0.5, a[4])):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out, final = fn(*leaves)
        (out.sin().sum() + final.cos().sum()).backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_fixed_decay_is_retnets():
    gamma = retnet_log_decay(4).exp()
    torch.testing.assert_close(gamma, 1 - 2.0 ** (-5 - torch.arange(4, dtype=torch.float64)))
    variant = GLAAttention(decay="fixed", short_conv=0, output_norm=False)
    assert testing.make_weights(variant) is None  # nothing learned
    q, k, v, mask = testing.make_inputs(padding="left")
    call = testing.make_call(True, mask, variant=variant)
    _, _, _, log_decay = variant.prepare(q, k, v, call)
    real = mask[:, None].expand_as(log_decay)
    torch.testing.assert_close(log_decay[0].exp(), gamma[:2, None].float().expand(2, q.shape[-2]))
    assert (log_decay[~real] == 0).all()


@pytest.mark.parametrize("decay", ["channel", "scalar", "fixed"])
def test_each_decay_setting_matches_its_recurrence_and_decodes_like_the_full_forward(decay):
    variant = GLAAttention(decay=decay, chunk_size=8)
    q, k, v, mask = testing.make_inputs(padding="left")
    call = testing.make_call(True, mask, variant=variant)
    out = run_variant(variant, q, k, v, call)
    testing.assert_matches_reference(variant, testing.real_rows(out, mask),
                                     testing.real_rows(testing.reference(variant, q, k, v, call), mask))
    testing.assert_decodes_like_the_full_forward("gla", decay=decay)


def test_channel_gate_starts_as_documented():
    weights = testing.make_weights(GLAAttention())
    source = torch.zeros(1, 3, weights.hidden_size)
    log_decay = weights.decay(source)
    assert log_decay.shape == (1, testing.HEADS, 3, testing.HEAD_DIM)
    torch.testing.assert_close(log_decay, torch.full_like(log_decay, -0.6931471805599453 / 16))  # bias 0


@pytest.mark.parametrize("gates", ["learned", "keys"])
@pytest.mark.parametrize("decay", ["channel", "scalar"])
def test_prefill_then_decode_equals_one_full_forward(decay, gates):
    model = testing.causal_lm("gla", decay=decay, gates=gates)
    ids = torch.randint(3, 64, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=position_ids).logits
        cache = zoo.make_cache(model)
        pieces = [model(ids[:, a:b], attention_mask=mask[:, :b], cache=cache, use_cache=True,
                        position_ids=position_ids[:, a:b]).logits for a, b in [(0, 19), *((t, t + 1) for t in
                                                                                         range(19, 30))]]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real], atol=1e-5, rtol=1e-4)
