"""``window_state`` (a softmax window and a recurrent state in one layer): the blocked kernel against the dense
reference for every state and both combinations, with sinks and left padding over several query blocks; LoLCATs'
formula written out for one query; the limits (a window longer than the sequence is causal softmax; the state reads
exactly the keys that left the window); decoding with the ring cache; refusals before any work."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from zoo.variants.window_state import WindowStateAttention

from zoo import testing
from zoo.cache import WindowStateLayer, cache_nbytes
from zoo.ops import window_state as window_ops
from zoo.testing import make_call, run_variant
from zoo.variant import VariantParameterError, reference

HEADS, DIM = 4, 8
STATES = [
    ("linear", "shared", {}),
    ("based", "shared", {"feature_dim": 4, "short_conv": 0}),
    ("linear", "mix", {}),
    ("gla", "mix", {"short_conv": 3}),
    ("deltanet", "mix", {"short_conv": 0}),
    ("gated_deltanet", "mix", {"short_conv": 3}),
]


def variant_of(state="linear", combine="shared", state_params=None, **params):
    return WindowStateAttention(state={"variant": state, "params": {"chunk_size": 16, **(state_params or {})}},
                                combine=combine, **params)


def inputs(n=70, left_pad=0, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, HEADS, n, DIM, generator=gen, dtype=dtype) for _ in range(3))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, :left_pad] = False
    return q, k, v, (mask if left_pad else None)


def call_for(variant, mask, dtype=torch.float64):
    return make_call(True, mask, head_dim=DIM, variant=variant, heads=HEADS, dtype=dtype)


@pytest.mark.parametrize("state, combine, state_params", STATES)
@pytest.mark.parametrize("window, sinks", [(8, 0), (8, 3), (20, 2)])
@pytest.mark.parametrize("left_pad", [0, 9])
def test_kernel_equals_the_dense_reference(state, combine, state_params, window, sinks, left_pad, monkeypatch):
    monkeypatch.setattr(window_ops, "MIN_QUERY_BLOCK", 16)  # several query blocks at n = 70
    variant = variant_of(state, combine, state_params, window=window, sinks=sinks)
    q, k, v, mask = inputs(left_pad=left_pad)
    call = call_for(variant, mask)
    out = run_variant(variant, q, k, v, call)
    expected = reference(variant, q, k, v, call)
    real = mask if mask is not None else torch.ones(2, q.shape[-2], dtype=torch.bool)
    torch.testing.assert_close(out.transpose(1, 2)[real], expected.transpose(1, 2)[real], atol=1e-9, rtol=1e-7)


def test_lolcats_formula_for_one_query():
    """y_i = (γ Σ_win e^{s−m} v + Σ_beyond φ(q)·φ(k) v) / (γ Σ_win e^{s−m} + Σ_beyond φ(q)·φ(k)), written out with
    φ = elu + 1 for the last query of a row, with γ = sigmoid(−2.1972) = 0.1 (LoLCATs' init)."""
    variant = variant_of(window=5)
    q, k, v, _ = inputs(n=12)
    call = call_for(variant, None)
    out = run_variant(variant, q, k, v, call)[0, 1, -1]
    i, scale, gamma = 11, DIM**-0.5, 1 / (1 + math.exp(2.1972245773362196))
    scores = [float(q[0, 1, i] @ k[0, 1, j]) * scale for j in range(7, 12)]
    top = max(scores)
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    num = sum(gamma * math.exp(s - top) * v[0, 1, j] for s, j in zip(scores, range(7, 12), strict=True))
    den = sum(gamma * math.exp(s - top) for s in scores)
    for j in range(0, 7):
        a = float(phi(q[0, 1, i]) @ phi(k[0, 1, j]))
        num, den = num + a * v[0, 1, j], den + a
    torch.testing.assert_close(out, num / den, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("state, combine, state_params", STATES)
def test_a_window_longer_than_the_sequence_is_causal_softmax(state, combine, state_params):
    """Nothing has left the window: shared gives softmax exactly (γ cancels); mix gives μ × softmax (the state is
    empty: its output is 0)."""
    variant = variant_of(state, combine, state_params, window=64)
    q, k, v, _ = inputs(n=40)
    call = call_for(variant, None)
    out = run_variant(variant, q, k, v, call)
    softmax = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=DIM**-0.5)
    if combine == "mix":
        softmax = softmax * torch.sigmoid(call.weights.factor)[None, :, None, None].to(softmax.dtype)
    torch.testing.assert_close(out, softmax, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("state, combine, state_params", STATES)
def test_the_state_reads_exactly_the_keys_that_left_the_window(state, combine, state_params):
    """Changing a key changes query i's output iff the key is at or before i (in the window or beyond it); changing a
    key once it has left the window still changes it (the state), a later key never does."""
    variant = variant_of(state, combine, state_params, window=6)
    q, k, v, _ = inputs(n=30)
    call = call_for(variant, None)
    out = run_variant(variant, q, k, v, call)
    for position, query, reached in ((3, 20, True), (18, 20, True), (25, 20, False)):
        changed = v.clone()
        changed[:, :, position] += 1.0
        moved = (run_variant(variant, q, k, changed, call)[:, :, query] - out[:, :, query]).abs().max()
        assert (moved > 1e-9) == reached, (position, query, moved)


def test_a_sink_is_read_by_softmax_and_never_enters_the_state():
    """With the state's output scaled to nothing (mix, μ → 1), a sink still moves a query far beyond the window; a
    key that left the window and is no sink does not."""
    variant = variant_of("linear", "mix", window=4, sinks=2, factor_init=40.0)
    q, k, v, _ = inputs(n=30)
    call = call_for(variant, None)
    out = run_variant(variant, q, k, v, call)
    for position, reached in ((1, True), (5, False)):
        changed = v.clone()
        changed[:, :, position] += 1.0
        moved = (run_variant(variant, q, k, changed, call)[:, :, -1] - out[:, :, -1]).abs().max()
        assert (moved > 1e-9) == reached, (position, moved)


def test_attention_weights_are_the_shared_distribution():
    variant = variant_of(window=6, sinks=1)
    q, k, v, mask = inputs(n=30, left_pad=5)
    call = call_for(variant, mask)
    weights = variant.attention_weights(q, k, call)
    real = mask
    torch.testing.assert_close(weights.sum(-1).transpose(1, 2)[real], torch.ones(int(real.sum()), HEADS,
                                                                                  dtype=weights.dtype))
    out = run_variant(variant, q, k, v, call)
    torch.testing.assert_close((weights @ v).transpose(1, 2)[real], out.transpose(1, 2)[real], atol=1e-9, rtol=1e-7)
    assert variant_of("gla", "mix").attention_weights(q, k, call_for(variant_of("gla", "mix"), mask)) is None


@pytest.mark.parametrize("state, combine, state_params", STATES[2:])
def test_cached_greedy_decoding_equals_the_full_forward(state, combine, state_params):
    """Every state through the ring cache, with sinks and a left-padded row (the contract suite runs ``linear``)."""
    testing.assert_decodes_like_the_full_forward(
        "window_state", combine=combine, sinks=2, window=6,
        state={"variant": state, "params": {"chunk_size": 16, **state_params}})


@pytest.mark.parametrize("state, combine, state_params", STATES)
@pytest.mark.parametrize("kv_heads", [HEADS, 2])
def test_decoding_steps_written_in_place_equal_the_uncached_kernel(state, combine, state_params, kv_heads,
                                                                    monkeypatch):
    """A prefill, one-token steps (each into a full ring: the oldest token into the state, the new one over its slot,
    the ring read in slot order), then a 5-token call (the ring put back in order): each call's rows equal the
    uncached kernel's, with grouped key/value heads too."""
    variant = variant_of(state, combine, state_params, window=6)
    q, k, v, _ = inputs(n=40)
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    call = call_for(variant, None)
    whole = run_variant(variant, q, k, v, call)
    steps = []
    in_place = WindowStateAttention._step
    monkeypatch.setattr(WindowStateAttention, "_step", lambda self, *args: steps.append(1) or in_place(self, *args))
    layer, pieces = WindowStateLayer(6, 0), []
    for start, stop in [(0, 20), *((i, i + 1) for i in range(20, 35)), (35, 40)]:
        layer.update(k[:, :, start:stop], v[:, :, start:stop], kwargs={})
        pieces.append(run_variant(variant, q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop],
                                  dataclasses.replace(call, cache=layer)))
    torch.testing.assert_close(torch.cat(pieces, dim=2), whole, atol=1e-10, rtol=1e-8)
    assert len(steps) == 15 and layer.ring_head == 0 and layer.held() == 6


def test_steps_under_autograd_keep_the_graph(monkeypatch):
    """A prefill with gradients; one-token steps whose queries carry gradients (they take the general path: the ring
    written in place would change what the window's product saved); then steps of plain tokens (in place, the state
    made under autograd updated out of place). Every row equals the uncached kernel's, and the outputs backpropagate
    to the queries and to the prefill's keys."""
    variant = variant_of("linear", "shared", window=6)
    q, k, v, _ = inputs(n=30)
    call = call_for(variant, None)
    whole = run_variant(variant, q, k, v, call)
    steps = []
    in_place = WindowStateAttention._step
    monkeypatch.setattr(WindowStateAttention, "_step", lambda self, *args: steps.append(1) or in_place(self, *args))
    prefill_keys, queries = k[:, :, :20].clone().requires_grad_(), q.clone().requires_grad_()
    layer = WindowStateLayer(6, 0)
    layer.update(prefill_keys, v[:, :, :20], kwargs={})
    pieces = [run_variant(variant, q[:, :, :20], prefill_keys, v[:, :, :20], dataclasses.replace(call, cache=layer))]
    for i in range(20, 30):
        layer.update(k[:, :, i : i + 1], v[:, :, i : i + 1], kwargs={})
        query = queries[:, :, i : i + 1] if i < 25 else q[:, :, i : i + 1]
        pieces.append(run_variant(variant, query, k[:, :, i : i + 1], v[:, :, i : i + 1],
                                  dataclasses.replace(call, cache=layer)))
    torch.testing.assert_close(torch.cat(pieces, dim=2), whole, atol=1e-10, rtol=1e-8)
    torch.cat(pieces[1:], dim=2).sum().backward()
    assert len(steps) == 5 and queries.grad[:, :, 20:25].abs().sum() > 0
    assert prefill_keys.grad[:, :, :14].abs().sum() > 0  # keys 0-13 entered the state in the prefill


def test_cached_greedy_decoding_without_sinks_steps_in_place(monkeypatch):
    """In a model: greedy decoding through the in-place steps (no sinks) gives the full forward's tokens."""
    steps = []
    in_place = WindowStateAttention._step
    monkeypatch.setattr(WindowStateAttention, "_step", lambda self, *args: steps.append(1) or in_place(self, *args))
    testing.assert_decodes_like_the_full_forward(
        "window_state", combine="mix", window=6, sinks=0,
        state={"variant": "gated_deltanet", "params": {"chunk_size": 16, "short_conv": 3}})
    assert steps


@pytest.mark.parametrize("state, combine", [("linear", "shared"), ("gated_deltanet", "mix")])
def test_beam_search_through_the_in_place_steps_equals_the_uncached_beams(state, combine, monkeypatch):
    """Beams reorder the ring between in-place steps (its rotation kept): the same beams as without a cache."""
    steps = []
    in_place = WindowStateAttention._step
    monkeypatch.setattr(WindowStateAttention, "_step", lambda self, *args: steps.append(1) or in_place(self, *args))
    model = testing.causal_lm("window_state", window=6, sinks=0, combine=combine, state=state)
    ids, mask = testing.decode_prompts()
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=3, pad_token_id=0)
    with torch.no_grad():
        cached, uncached = model.generate(ids, **settings), model.generate(ids, use_cache=False, **settings)
    assert torch.equal(cached, uncached) and steps


def test_cache_holds_the_ring_the_sinks_and_the_state_only():
    model = testing.causal_lm("window_state", window=6, sinks=2)
    ids, mask = testing.decode_prompts()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True)
    layer = out.past_key_values.layers[0]
    assert isinstance(layer, WindowStateLayer) and layer.held() == 6
    config = model.config
    heads, dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    batch = ids.shape[0]
    ring = 2 * batch * heads * 6 * dim * 4 + batch * 6  # keys, values (fp32) and the real flags
    tokens = batch * heads * 6 * (dim + dim) * 4  # φ(k) (elu: d features) and v per ring token
    sinks = 2 * batch * heads * 2 * dim * 4 + batch * 2
    state = batch * heads * dim * (dim + 1) * 4
    assert layer.nbytes() == ring + tokens + sinks + state
    assert cache_nbytes(out.past_key_values) == config.num_hidden_layers * layer.nbytes()


@pytest.mark.parametrize("params, message", [
    ({"window": 0}, "window"),
    ({"state": "gla"}, "combine='mix'"),
    ({"state": "sdpa"}, "not a recurrent variant"),
    ({"state": "nope"}, "state"),
    ({"state": {"variant": "linear", "extra": 1}}, "must be a variant name"),
    ({"state": {"variant": "gla", "params": {"decay": "nope"}}, "combine": "mix"}, "decay"),
])
def test_bad_parameters_are_refused_naming_them(params, message):
    with pytest.raises(VariantParameterError, match=message):
        WindowStateAttention(**params)


def test_a_window_beyond_the_model_positions_is_refused_before_any_work():
    with pytest.raises(VariantParameterError, match="max_position_embeddings"):
        testing.causal_lm("window_state", window=10_000)


def test_decoding_without_its_cache_is_refused():
    variant = variant_of()
    q, k, v, _ = inputs(n=20)
    with pytest.raises(ValueError, match="WindowStateLayer"):
        run_variant(variant, q[:, :, -1:], k, v, call_for(variant, None))


@pytest.mark.parametrize("state, combine, state_params", [STATES[0], STATES[5]])
def test_no_quadratic_tensor_at_4096(state, combine, state_params):
    testing.assert_memory_below_quadratic(variant_of(state, combine, state_params))


def test_shift_delays_by_the_window_with_zeros():
    x = torch.arange(1.0, 7.0).view(1, 1, 6, 1)
    assert window_ops.shifted(x, 2).flatten().tolist() == [0, 0, 1, 2, 3, 4]
