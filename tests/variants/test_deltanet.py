"""``deltanet`` / ``gated_deltanet`` and their kernel zoo.ops.delta_rule: the chunkwise UT form equals the
token-by-token recurrence (fp64, lengths that are not chunk multiples, with and without decay and an initial state),
so do its gradients; it matches transformers' own chunked gated delta rule (Qwen3-Next) as an independent peer;
inside Llama (GQA) prefill-then-decode equals one full forward, padding neither leaks nor shifts anything, the
learned weights start as documented and a checkpoint without them gets them with one log line; decoding keeps
the state and the convolution inputs, bounded, refusing rollbacks."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
from zoo.variants.deltanet import DeltaNetAttention
from zoo.variants.gated_deltanet import GatedDeltaNetAttention

import zoo
from zoo import testing
from zoo.cache import CacheRollbackError, RecurrentLayer, cache_nbytes
from zoo.ops.delta_rule import delta_rule, l2_normalized
from zoo.ops.delta_rule.naive import delta_rule_recurrence
from zoo.testing import run_variant  # the plug's entry point, wherever the package keeps it


def inputs(n: int, batch: int = 2, heads: int = 3, d_k: int = 8, d_v: int = 5, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, n, d_k, generator=gen, dtype=dtype) for _ in range(2))
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(batch, heads, n, d_v, generator=gen, dtype=dtype)
    beta = torch.rand(batch, heads, n, generator=gen, dtype=dtype)
    log_decay = -torch.rand(batch, heads, n, generator=gen, dtype=dtype)
    state = torch.randn(batch, heads, d_k, d_v, generator=gen, dtype=dtype)
    return q, k, v, beta, log_decay, state


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("n, chunk", [(1, 8), (13, 8), (37, 8), (40, 64), (29, 1)])
def test_chunked_form_equals_the_recurrence(gated, n, chunk):
    q, k, v, beta, log_decay, state = inputs(n)
    log_decay = log_decay if gated else None
    for initial in (None, state):
        out, final = delta_rule(q, k, v, beta, log_decay, 0.3, chunk, initial)
        want, want_final = delta_rule_recurrence(q, k, v, beta, log_decay, 0.3, initial)
        torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
        torch.testing.assert_close(final, want_final, atol=1e-6, rtol=0)


def test_beta_up_to_two_and_strong_decay_stay_exact():
    """Negative eigenvalues (β ∈ (0, 2)) and decays near 0 (log α = −30): no overflow, still the recurrence."""
    q, k, v, beta, log_decay, _ = inputs(45)
    out, _ = delta_rule(q, k, v, 2 * beta, 30 * log_decay, 1.0, 16)
    torch.testing.assert_close(out, delta_rule_recurrence(q, k, v, 2 * beta, 30 * log_decay, 1.0)[0], atol=1e-6,
                               rtol=0)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("n", [21, 1])  # 1: a decoding step's own path
def test_gradients_equal_the_recurrences(gated, n):
    tensors = list(inputs(n, batch=1, heads=2))
    if not gated:
        tensors[4] = None
    grads = []
    for chunked in (True, False):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in tensors]
        q, k, v, beta, log_decay, state = leaves
        if chunked:
            out, final = delta_rule(q, k, v, beta, log_decay, 0.5, 8, state)
        else:
            out, final = delta_rule_recurrence(q, k, v, beta, log_decay, 0.5, state)
        (out.sin().sum() + final.cos().sum()).backward()
        grads.append([t.grad for t in leaves if t is not None])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_matches_transformers_chunked_gated_delta_rule():
    """An independent peer: transformers' torch_chunk_gated_delta_rule (Qwen3-Next; fp32 inside, d_k^-½ scaling,
    tensors (B, n, H, d)) with its own L2 norm of q and k, against the zoo kernel on normalized q and k."""
    q, k, v, beta, log_decay, state = inputs(50, d_k=8, d_v=8, dtype=torch.float32)
    raw_q = q * 3
    peer, peer_state = torch_chunk_gated_delta_rule(
        *(x.transpose(1, 2) for x in (raw_q, k, v, log_decay, beta)), chunk_size=16, initial_state=state,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    normalized = torch.nn.functional.normalize(raw_q, dim=-1, eps=1e-6)
    out, final = delta_rule(normalized, k, v, beta, log_decay, 8**-0.5, 64, state)
    torch.testing.assert_close(out, peer.transpose(1, 2), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, peer_state, atol=2e-5, rtol=1e-5)


def test_half_precision_accumulates_in_fp32():
    q, k, v, beta, log_decay, _ = inputs(70, dtype=torch.float32)
    want, _ = delta_rule(q, k, v, beta, log_decay, 0.3, 16)
    out, final = delta_rule(*(x.bfloat16() for x in (q, k, v, beta, log_decay)), 0.3, 16)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32 and torch.isfinite(out).all()
    assert testing.relative_error(out.float(), want) < 0.02


# ---------------------------------------------------------------------------------------------------------
# the variants


VARIANTS = ["deltanet", "gated_deltanet"]


@pytest.mark.parametrize("name", VARIANTS)
def test_bidirectional_use_is_refused(name):
    variant = testing.make_variant(name)
    q, k, v, _ = testing.make_inputs(padding=None)
    with pytest.raises(ValueError, match="supports causal attention only"):
        run_variant(variant, q, k, v, testing.make_call(False, variant=variant))


def test_negative_eigenvalues_double_beta():
    q, k, v, mask = testing.make_inputs(padding="left")
    plain, negative = DeltaNetAttention(), DeltaNetAttention(allow_negative_eigenvalues=True)
    call = testing.make_call(True, mask, variant=plain)
    weights = call.weights
    _, _, _, beta, _ = plain.prepare(q, k, v, call)
    _, _, _, beta2, _ = negative.prepare(q, k, v, call)
    torch.testing.assert_close(beta2, 2 * beta)
    assert 0 < beta[mask[:, None].expand_as(beta)].min() and beta.max() < 1
    assert (beta[~mask[:, None].expand_as(beta)] == 0).all(), "padded tokens must not write"
    assert not torch.allclose(run_variant(negative, q, k, v, call), run_variant(plain, q, k, v, call))
    assert weights.beta.weight.shape == (testing.HEADS, testing.HEADS * testing.HEAD_DIM)


def test_weights_start_as_documented():
    config = testing.tiny_model_config("llama", "gated_deltanet")
    layer = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].self_attn.attention_zoo
    bound = (6 / (32 + 4)) ** 0.5 * 2**-2.5  # Xavier-uniform, gain 2^-2.5, (4 heads, hidden 32)
    assert layer.beta.weight.abs().max() <= bound and layer.decay.proj.weight.abs().max() <= bound
    a = layer.decay.A_log.exp()
    assert ((1 <= a) & (a <= 16)).all()
    dt = torch.nn.functional.softplus(layer.decay.dt_bias)
    assert ((1e-4 <= dt) & (dt <= 0.1 + 1e-6)).all()
    assert layer.conv.q.weight.shape == (4 * 8, 1, 4) and layer.conv.q.weight.abs().max() <= 0.5  # U(±1/√4)
    assert (layer.norm.weight == 1).all() and layer.norm.weight.shape == (8,)  # one gain per value channel


def llama(name: str, **params):
    return testing.causal_lm(name, **params)


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("short_conv", [0, 4])
def test_prefill_then_decode_equals_one_full_forward(name, short_conv):
    """Llama with GQA: a 23-token prefill through the cache, then 9 tokens one by one (and one chunk of 4), gives
    the logits of one forward over all 36 tokens, with a left-padded row."""
    model = llama(name, short_conv=short_conv)
    ids = torch.randint(3, 64, (2, 36), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
        cache = zoo.make_cache(model)
        steps = [(0, 23)] + [(t, t + 1) for t in range(23, 32)] + [(32, 36)]
        pieces = []
        for start, stop in steps:
            pieces.append(model(ids[:, start:stop], attention_mask=mask[:, :stop], cache=cache, use_cache=True,
                                position_ids=positions(mask)[:, start:stop]).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real], atol=1e-5, rtol=1e-4)
    assert all(isinstance(layer, RecurrentLayer) for layer in cache.layers)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("short_conv", [0, 4])
def test_padding_amount_and_content_change_nothing(name, short_conv):
    """The same tokens with 0, 3 or 9 left pads (any pad ids) or right pads: the same outputs at real tokens."""
    model = llama(name, short_conv=short_conv)
    ids = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids).logits[0]
        for pad in (3, 9):
            for side in ("left", "right"):
                filler = torch.randint(3, 64, (1, pad), generator=torch.Generator().manual_seed(pad))
                padded = torch.cat([filler, ids] if side == "left" else [ids, filler], -1)
                mask = torch.ones_like(padded)
                if side == "left":
                    mask[:, :pad] = 0
                else:
                    mask[:, -pad:] = 0
                got = model(padded, attention_mask=mask, position_ids=positions(mask)).logits[0][mask[0].bool()]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", VARIANTS)
def test_beam_search_and_greedy_with_the_cache_equal_decoding_without_it(name):
    model = llama(name)
    ids, mask = testing.decode_prompts()
    with torch.no_grad():
        for extra in ({}, {"num_beams": 3, "num_return_sequences": 2}):
            cached = testing.greedy(model, ids, mask, **extra)
            torch.testing.assert_close(cached, testing.greedy(model, ids, mask, use_cache=False, **extra), rtol=0,
                                       atol=0)


def test_cache_holds_the_state_and_the_convolution_inputs_whatever_the_prompt_length():
    model = llama("deltanet")
    sizes = []
    for length in (30, 70):
        with torch.no_grad():
            out = testing.greedy(model, *testing.decode_prompts(length), return_dict_in_generate=True)
        sizes.append(cache_nbytes(out.past_key_values))
        state = out.past_key_values.layers[0].state
        assert set(state) == {"delta", "conv_q", "conv_k", "conv_v"}
    batch, heads, head_dim, layers, taps = 2, 4, 8, 2, 4
    per_layer = batch * heads * head_dim * head_dim * 4 + 3 * batch * heads * head_dim * (taps - 1) * 4
    assert sizes == [layers * per_layer] * 2


def test_rollbacks_are_refused():
    model = llama("deltanet")
    cache = zoo.make_cache(model)
    ids, mask = testing.decode_prompts()
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
    with pytest.raises(CacheRollbackError, match="cannot be rolled back"):
        cache.crop(-1)
    with pytest.raises(CacheRollbackError, match="Assisted decoding.*cannot be rolled back"):
        testing.greedy(model, ids, mask, assistant_model=llama("sdpa"))


def test_a_checkpoint_without_the_weights_gets_their_init_and_one_log_line(tmp_path, caplog):
    model = llama("gated_deltanet")
    model.save_pretrained(tmp_path)
    weights_file = tmp_path / "model.safetensors"
    tensors = {key: t for key, t in load_file(weights_file).items() if "attention_zoo" not in key}
    save_file(tensors, weights_file, metadata={"format": "pt"})
    with caplog.at_level(logging.INFO):
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    lines = [r.getMessage() for r in caplog.records if "attention-zoo" in r.getMessage()]
    assert len(lines) == 1 and "attention_zoo.beta.weight" in lines[0] and "attention_zoo.decay.A_log" in lines[0]
    fresh = llama("gated_deltanet")
    for key, tensor in fresh.state_dict().items():
        if "attention_zoo" in key:
            torch.testing.assert_close(reloaded.state_dict()[key], tensor, atol=0, rtol=0)


def test_gated_decay_is_zero_on_padding_and_in_range():
    variant = GatedDeltaNetAttention()
    q, k, v, mask = testing.make_inputs(padding="right")
    _, _, _, _, log_decay = variant.prepare(q, k, v, testing.make_call(True, mask, variant=variant))
    real = mask[:, None].expand_as(log_decay)
    assert (log_decay[~real] == 0).all() and (log_decay[real] < 0).all()


@pytest.mark.parametrize("family", ["gpt2", "mistral", "qwen2"])
def test_other_families_decode_like_the_full_forward(family):
    """GPT-2 (absolute positions, no rotary), Mistral (one kv head) and Qwen2 hand the hidden states and the cache
    over like Llama."""
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    config = {
        "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=1,
                                                eos_token_id=2),
        "mistral": lambda: transformers.MistralConfig(**small, num_key_value_heads=1, sliding_window=None),
        "qwen2": lambda: transformers.Qwen2Config(**small, num_key_value_heads=2),
    }[family]()
    zoo.configure(config, "gated_deltanet")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
        ids, mask = testing.decode_prompts()
        torch.testing.assert_close(testing.greedy(model, ids, mask), testing.greedy(model, ids, mask, use_cache=False),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("gated", [False, True])
def test_hand_written_backward_passes_gradcheck(gated):
    """The chunk loop's hand-written backward (zoo.ops.delta_rule.chunk._ChunkLoop), fp64 finite differences: a
    length that is no chunk multiple, an initial state, with and without decay; the recurrence's gradients are checked
    above."""
    q, k, v, beta, log_decay, state = (x.requires_grad_() for x in inputs(11, batch=1, heads=2, d_k=3, d_v=2))
    decay = log_decay if gated else None

    def f(q, k, v, beta, state, *rest):
        out, final = delta_rule(q, k, v, beta, rest[0] if rest else None, 0.7, 4, state)
        return out, final

    args = (q, k, v, beta, state) + ((decay,) if gated else ())
    assert torch.autograd.gradcheck(f, args)


def test_l2_normalized_is_f_normalize_with_its_gradient():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: l2_normalized(x, 1e-6), (x.clone().requires_grad_(),))
    x[0, 0, 0] = 1e-8  # clamped at eps
    grads = []
    for f in (l2_normalized, lambda x: torch.nn.functional.normalize(x, dim=-1, eps=1e-6)):
        leaf = x.clone().requires_grad_()
        out = f(leaf)
        out.sin().sum().backward()
        grads.append((out, leaf.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1])
