"""``linear`` (Katharopoulos et al. 2020) and the shared kernel zoo.ops.linear_attention: the chunked kernel equals
the O(n²) definition of its own attention (which the contract suite uses as its reference), with causality,
padding, KV-cache alignment and any chunk size; fp32 accumulation; nothing n x n."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from zoo.variants.linear import LinearAttention

import zoo
from zoo.ops import linear_attention
from zoo.ops.linear.naive import linear_attention_loop
from zoo.plug.dispatch import run_variant
from zoo.testing import assert_memory_below_quadratic
from zoo.variant import AttentionCall, Variant


def qkv(n: int, batch: int = 2, heads: int = 2, head_dim: int = 8, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, head_dim, generator=gen).to(dtype) for _ in range(3)]


def padding(batch: int, n: int, real: int, side: str = "right") -> torch.Tensor:
    mask = torch.ones(batch, n, dtype=torch.bool)
    if side == "right":
        mask[-1, real:] = False
    else:
        mask[-1, : n - real] = False
    return mask


def call(causal: bool, mask: torch.Tensor | None = None) -> AttentionCall:
    return AttentionCall(causal=causal, scaling=1.0, padding_mask=mask)


def equation(q, k, v, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    """The paper's equation written out (:func:`zoo.ops.linear.naive.linear_attention_loop`) with φ = elu + 1."""
    return linear_attention_loop(F.elu(q) + 1, F.elu(k) + 1, v, causal, mask)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_the_papers_equation(causal):
    q, k, v = qkv(9)
    mask = padding(2, 9, real=6)
    reference = LinearAttention().reference
    torch.testing.assert_close(reference(q, k, v, call(causal, mask)), equation(q, k, v, causal, mask))
    # causal queries sit at the end of the keys (a KV cache)
    torch.testing.assert_close(reference(q[..., -3:, :], k, v, call(True, mask)),
                               equation(q[..., -3:, :], k, v, True, mask))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 5, 37, 130])
@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64, None])
@pytest.mark.parametrize("side", ["right", "left"])
def test_chunked_kernel_equals_the_reference(causal, n, chunk_size, side):
    variant = LinearAttention(chunk_size=chunk_size)
    q, k, v = qkv(n)
    mask = padding(2, n, real=max(1, n * 2 // 3), side=side)
    got = run_variant(variant, q, k, v, call(causal, mask))
    want = variant.reference(q, k, v, call(causal, mask)).masked_fill(~mask[:, None, :, None], 0.0)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_the_reference(causal):
    variant = LinearAttention(chunk_size=16)
    q, k, v = qkv(50)
    mask = padding(2, 50, real=31)
    grad_out = torch.randn_like(q)
    grads = []
    for fn in (run_variant, lambda var, *x: var.reference(*x)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(variant, *leaves, call(causal, mask)).masked_fill(~mask[:, None, :, None], 0.0)
        grads.append(torch.autograd.grad((out * grad_out).sum(), leaves))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)


def test_kv_cache_steps_equal_the_full_forward_rows():
    variant = LinearAttention(chunk_size=8)
    q, k, v = qkv(45)
    full = run_variant(variant, q, k, v, call(True))
    for t in (0, 7, 8, 44):
        step = run_variant(variant, q[..., t : t + 1, :], k[..., : t + 1, :], v[..., : t + 1, :], call(True))
        torch.testing.assert_close(step[..., 0, :], full[..., t, :])
    several = run_variant(variant, q[..., -5:, :], k, v, call(True))
    torch.testing.assert_close(several, full[..., -5:, :])


def test_llama_generation_with_a_cache_equals_generation_without():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(zoo.configure(config, "linear", chunk_size=4)).eval()
    prompt = torch.randint(0, 64, (1, 11))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_inf_and_nan_in_padded_positions_never_reach_real_outputs():
    variant = LinearAttention(chunk_size=8)
    for causal in (False, True):
        q, k, v = qkv(30)
        mask = padding(2, 30, real=19)
        clean = run_variant(variant, q, k, v, call(causal, mask))
        pad = ~mask[:, None, :, None]
        garbage = (float("inf"), float("inf"), float("nan"))
        dirty = [x.masked_fill(pad, value) for x, value in zip((q, k, v), garbage, strict=True)]
        out = run_variant(variant, *dirty, call(causal, mask))
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, clean)


def test_a_query_with_no_real_key_outputs_zeros_not_nan():
    phi = torch.rand(2, 1, 6, 4)
    v = torch.randn(2, 1, 6, 3)
    mask = torch.tensor([[True] * 6, [False] * 6])
    for causal in (False, True):
        out = linear_attention(phi, phi, v, causal, key_mask=mask, chunk_size=4)
        assert torch.isfinite(out).all() and (out[1] == 0).all() and (out[0] != 0).all()


def test_low_precision_inputs_accumulate_in_fp32():
    variant = LinearAttention(chunk_size=16)
    q, k, v = qkv(100, dtype=torch.float32)
    for causal in (False, True):
        full = run_variant(variant, q, k, v, call(causal))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast must not lower the kernel's precision
            assert torch.equal(run_variant(variant, q, k, v, call(causal)), full)
        half = run_variant(variant, *(x.bfloat16() for x in (q, k, v)), call(causal))
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), full, atol=0.03, rtol=0.03)


def test_no_n_by_n_intermediate_at_4096():
    """head_dim 64 (the d x d prefix state grows with it), both modes, forward and backward."""
    assert_memory_below_quadratic(LinearAttention(), head_dim=64)


def test_flops_grow_linearly_in_n():
    variant = LinearAttention()
    for causal in (False, True):
        assert variant.flops(8192, 12, 64, causal) == pytest.approx(2 * variant.flops(4096, 12, 64, causal))
        assert variant.flops(4096, 12, 64, causal) < Variant.flops(variant, 4096, 12, 64, causal) / 10  # dense


# ---------------------------------------------------------------------------------------------------
# feature_map: hedgehog (Zhang et al. 2024), learned per layer


def hedgehog(head_dim: int = 8, heads: int = 2, feature_dim: int | None = None, short_conv: int = 0,
             seed: int = 0, **params) -> tuple[LinearAttention, torch.nn.Module]:
    """A hedgehog ``linear`` and one layer's weights moved off their identity start (fp64), as training leaves them."""
    variant = LinearAttention(feature_map="hedgehog", feature_dim=feature_dim, short_conv=short_conv, **params)
    torch.manual_seed(seed)
    weights = variant.make_module(0, None, head_dim, heads).double()
    with torch.no_grad():
        for param in weights.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return variant, weights


def weighted(causal: bool, weights: torch.nn.Module | None, mask: torch.Tensor | None = None,
             scaling: float = 1.0) -> AttentionCall:
    return AttentionCall(causal=causal, scaling=scaling, padding_mask=mask, weights=weights)


def test_hedgehog_features_are_positive_and_each_half_sums_to_one():
    variant, weights = hedgehog(feature_dim=5)
    q, k, v = qkv(11)
    phi_q, phi_k, values = variant.features(q, k, v, weighted(True, weights))
    assert phi_q.shape == phi_k.shape == (2, 2, 11, 10) and phi_q.dtype == torch.float64
    for phi in (phi_q, phi_k):
        assert (phi > 0).all()
        torch.testing.assert_close(phi[..., :5].sum(-1), torch.ones(2, 2, 11, dtype=torch.float64))
        torch.testing.assert_close(phi[..., 5:].sum(-1), torch.ones(2, 2, 11, dtype=torch.float64))
    assert torch.equal(values, v)  # no convolution: v as given
    same_q, same_k, _ = variant.features(q, q, v, weighted(True, weights))
    assert torch.equal(same_q, phi_q) and not torch.allclose(same_k, phi_q)  # q and k have maps of their own


def test_hedgehog_starts_as_softmax_of_x_and_of_minus_x():
    """W = identity, b = 0: φ(x) = [softmax(x) ⊕ softmax(−x)], written out by hand."""
    variant = LinearAttention(feature_map="hedgehog")
    weights = variant.make_module(0, None, 4, 1).double()
    x = torch.tensor([[[[0.5, -1.0, 2.0, 0.0]]]], dtype=torch.float64)
    e, f = x.exp(), (-x).exp()
    want = torch.cat([e / e.sum(), f / f.sum()], dim=-1)
    phi_q, phi_k, _ = variant.features(x, x, x, weighted(False, weights))
    torch.testing.assert_close(phi_q, want)
    torch.testing.assert_close(phi_k, want)
    assert [tuple(p.shape) for p in weights.parameters()] == [(1, 4, 4), (1, 4, 4), (1, 4), (1, 4)]


def test_hedgehog_kernel_grows_with_the_dot_product_along_a_ray():
    """At the identity start, φ(q)·φ(s·q) rises strictly with s (so with q·k = s·|q|²): E over softmax(s·q) of the
    increasing softmax(q)_i grows with s (Chebyshev's sum inequality), and likewise for the −x half -- the monotone
    spikiness softmax's exp(q·k) has and elu + 1 lacks (its kernel is not monotone in s for this q)."""
    variant = LinearAttention(feature_map="hedgehog")
    weights = variant.make_module(0, None, 6, 1).double()
    q = torch.tensor([0.9, -1.3, 0.2, 2.1, -0.4, 0.0], dtype=torch.float64)
    scales = torch.linspace(-4, 4, 41, dtype=torch.float64)
    keys = (scales[:, None] * q)[None, None]
    phi_q, phi_k, _ = variant.features(q[None, None, None], keys, keys, weighted(False, weights))
    kernel = (phi_q @ phi_k.transpose(-1, -2)).flatten()
    assert (kernel.diff() > 0).all()
    elu = (F.elu(q) + 1) @ (F.elu(keys[0, 0]) + 1).T
    assert not (elu.diff() > 0).all()


def test_feature_dim_belongs_to_hedgehog():
    with pytest.raises(zoo.VariantParameterError, match="feature_dim=8.*feature_map='hedgehog'"):
        LinearAttention(feature_dim=8)
    assert LinearAttention(feature_map="hedgehog", feature_dim=8).feature_count(16) == 16
    assert LinearAttention(feature_map="hedgehog").feature_count(16) == 32 and LinearAttention().feature_count(16) == 16


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("feature_dim", "short_conv", "chunk_size"), [(None, 0, 4), (5, 0, None), (12, 3, 7)])
def test_hedgehog_chunked_kernel_equals_the_reference(causal, feature_dim, short_conv, chunk_size):
    variant, weights = hedgehog(feature_dim=feature_dim, short_conv=short_conv, chunk_size=chunk_size)
    q, k, v = qkv(37)
    mask = padding(2, 37, real=25, side="left" if causal else "right")
    got = run_variant(variant, q, k, v, weighted(causal, weights, mask))
    want = variant.reference(q, k, v, weighted(causal, weights, mask)).masked_fill(~mask[:, None, :, None], 0.0)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_hedgehog_decoding_state_continues_the_prefill():
    """features(..., state) continues the convolution from the state: a prefill then single steps through a
    RecurrentLayer's state equal the full forward's rows."""
    from zoo.cache import RecurrentLayer

    variant, weights = hedgehog(short_conv=4, chunk_size=8)
    q, k, v = qkv(30)
    full = run_variant(variant, q, k, v, weighted(True, weights))
    layer = RecurrentLayer()
    steps = [run_variant(variant, q[..., :20, :], k[..., :20, :], v[..., :20, :],
                         AttentionCall(causal=True, scaling=1.0, weights=weights, cache=layer))]
    for t in range(20, 30):
        steps.append(run_variant(variant, q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :],
                                 AttentionCall(causal=True, scaling=1.0, weights=weights, cache=layer)))
    torch.testing.assert_close(torch.cat(steps, dim=2), full)


@pytest.mark.parametrize("feature_map", ["elu", "hedgehog"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_weights_are_distributions_that_give_the_reference(feature_map, causal):
    if feature_map == "hedgehog":
        variant, weights = hedgehog(feature_dim=6, short_conv=3)
    else:
        variant, weights = LinearAttention(short_conv=3), None
        torch.manual_seed(0)
        weights = variant.make_module(0, None, 8, 2).double()
    q, k, v = qkv(23)
    mask = padding(2, 23, real=15, side="left")
    call_ = weighted(causal, weights, mask)
    probs = variant.attention_weights(q, k, call_)
    assert probs.shape == (2, 2, 23, 23) and probs.dtype == torch.float64 and (probs >= 0).all()
    real = mask[:, None, :, None].expand(2, 2, 23, 1)[..., 0]
    torch.testing.assert_close(probs.sum(-1)[real], torch.ones(int(real.sum()), dtype=torch.float64))
    assert (probs[:, :, :, ~mask[1]][1] == 0).all()  # no weight on a padded key
    if causal:
        assert (probs.triu(1) == 0).all()
    values = variant.features(q, k, v, call_)[2]  # v after the short convolution
    torch.testing.assert_close((probs @ values)[real], variant.reference(q, k, v, call_)[real])


def test_variants_without_attention_weights_say_so():
    q, k, _ = qkv(5)
    assert zoo.get_variant_class("gated_deltanet")().attention_weights(q, k, call(True)) is None
    assert zoo.get_variant_class("linear").overrides("attention_weights")


def test_parameter_names_elu_keeps_and_hedgehog_adds():
    """An elu ``linear`` with short_conv keeps the names saved models have; hedgehog holds its maps and the conv."""
    elu = dict(LinearAttention(short_conv=4).make_module(0, None, 8, 2).named_parameters())
    assert sorted(elu) == ["k.weight", "q.weight", "v.weight"]
    assert LinearAttention().make_module(0, None, 8, 2) is None
    names = dict(LinearAttention(feature_map="hedgehog", short_conv=4).make_module(0, None, 8, 2).named_parameters())
    assert sorted(names) == ["bias_k", "bias_q", "conv.k.weight", "conv.q.weight", "conv.v.weight", "feature_k",
                             "feature_q"]


def test_hedgehog_weights_save_and_reload_with_the_model(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        zoo.configure(config, "linear", feature_map="hedgehog", feature_dim=4, short_conv=2)
    ).eval()
    key = "model.layers.1.self_attn.attention_zoo.feature_k"
    assert model.state_dict()[key].shape == (4, 4, 8)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".attention_zoo." in name:
                param.add_(0.2 * torch.randn_like(param))
    ids = torch.randint(0, 64, (2, 17))
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    state = reloaded.state_dict()
    for name, tensor in model.state_dict().items():
        if ".attention_zoo." in name:
            assert torch.equal(state[name], tensor), name
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_hedgehog_allocates_no_n_by_n_tensor_and_counts_its_maps():
    variant = LinearAttention(feature_map="hedgehog", feature_dim=32)
    assert_memory_below_quadratic(variant, head_dim=64)
    for causal in (False, True):
        assert variant.flops(8192, 12, 64, causal) == pytest.approx(2 * variant.flops(4096, 12, 64, causal))
        assert variant.flops(4096, 12, 64, causal) > LinearAttention().flops(4096, 12, 64, causal)  # 64 features + maps


def _contract_cases() -> list:
    """Every test of the contract suite (zoo.testing.contract) that takes a variant ``name``, at each of its other
    parameters, for ``linear``."""
    from _pytest.mark.structures import ParameterSet

    from zoo.testing import contract

    cases = []
    for test_name, fn in vars(contract).items():
        if not test_name.startswith("test_") or not callable(fn):
            continue
        combos = [{}]
        for mark in getattr(fn, "pytestmark", []):
            if mark.name != "parametrize":
                continue
            names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else mark.args[0]
            grown = []
            # a list over ``name`` alone was filtered at collection by what elu ``linear`` declares (no learned
            # weights): every such declaration holds for hedgehog, so each test runs (and re-asks it, ``require``)
            for value in ["linear"] if names == ["name"] else mark.args[1]:
                value = value.values if isinstance(value, ParameterSet) else value
                given = dict(zip(names, value if len(names) > 1 else (value,), strict=True))
                if given.get("name", "linear") == "linear":
                    grown += [{**combo, **given} for combo in combos]
            combos = grown
        for combo in combos:
            if "name" in combo:
                label = "-".join(str(v) for k, v in combo.items() if k != "name") or "-"
                cases.append(pytest.param(fn, combo, id=f"{test_name}[{label}]"))
    return cases


@pytest.mark.parametrize(("test", "kwargs"), _contract_cases())
def test_contract_suite_with_hedgehog_features(test, kwargs, monkeypatch):
    """The contract suite's tests of ``linear`` again, its ``test_params`` switched to ``feature_map: hedgehog`` (every
    test builds the variant, its weights and its tiny models from them)."""
    monkeypatch.setattr(LinearAttention, "test_params", {"chunk_size": 16, "feature_map": "hedgehog",
                                                         "feature_dim": 8})
    test(**kwargs)
