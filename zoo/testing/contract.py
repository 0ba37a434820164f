"""The variant contract suite: pytest tests parametrized over every registered variant, plugins included.

Run it on the installed variants (the project's tests import it) or on your own plugin::

    pytest --pyargs zoo.contract -k my_variant

Each kernel is called through the same plumbing transformers uses (:func:`zoo.plug.dispatch.run_variant`) on small
inputs (batch 2, 2 heads, n=100, head_dim 16, q/k/v ~ N(0, 1), the second row padded) built with the
variant's ``test_params``. Exact variants must equal their reference -- softmax attention restricted to
their own pattern -- within 1e-5 in fp32; approximate ones must stay within their ``error_bound``. A variant
that declares memory below O(n²) must allocate no n x n tensor at n = 4096 (forward and backward). A variant
with learned per-layer weights (``make_module``) gets them in every kernel call (``make_call(..., variant=...)``,
seeded as in a model), and its weights must receive gradients and reload identically.

The helpers (inputs, the reference, comparisons, the allocation probe, the reload check) live in
:mod:`zoo.testing`, for a plugin's own tests beyond this suite.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from zoo.plug.dispatch import run_variant
from zoo.plug.install import configure
from zoo.plug.spec import variant_spec
from zoo.registry import get_variant_class, list_variants
from zoo.testing import (
    ATOL,
    MEMORY_CHECK_LENGTH,
    REAL_LENGTH,
    LargestAllocation,  # noqa: F401  (importable from zoo.contract, as before zoo.testing existed)
    N,
    assert_cache_bytes_bounded,
    assert_decodes_like_the_full_forward,
    assert_invariant_to_padding_amount,
    assert_matches_reference,
    assert_memory_below_quadratic,
    assert_reloads_identically,
    assert_runs_under_autocast,
    assert_weights_train_and_reload,
    declares_bounded_cache,
    declares_subquadratic_memory,
    declares_weights,
    make_call,
    make_inputs,
    make_variant,
    model_inputs,
    modes,
    real_rows,
    reference,
    relative_error,
    tiny_model_config,
)
from zoo.variant import Param, Variant, VariantParameterError

VARIANTS = list_variants()


def _causal(name: str) -> bool:
    return get_variant_class(name).supports_causal


def _bidirectional(name: str) -> bool:
    return get_variant_class(name).supports_bidirectional


def _subquadratic(name: str) -> bool:
    return declares_subquadratic_memory(get_variant_class(name))


def _has_weights(name: str) -> bool:
    return declares_weights(make_variant(name))


def _bounded_decoder(name: str) -> bool:
    return _causal(name) and declares_bounded_cache(name)


def variants_where(declares) -> list[str]:
    """The variants for which ``declares(name)`` holds, asked at collection. A plugin whose answer raises (its
    parameters, weights or cache fail to build) is kept, and the test asks again (:func:`require`), so it fails as
    that plugin's test instead of stopping the collection of every variant's tests."""
    names = []
    for name in VARIANTS:
        try:
            keep = declares(name)
        except Exception:  # re-raised inside the test, as its failure
            keep = True
        if keep:
            names.append(name)
    return names


def require(declares, name: str) -> None:
    """Ask again inside the test what :func:`variants_where` asked at collection; an error fails this test only."""
    assert declares(name), f"{name}: {declares.__name__} held at collection and no longer does"


# ------------------------------------------------------------------------------------------------------
# declarations


@pytest.mark.parametrize("name", VARIANTS)
def test_declares_the_contract(name):
    cls = get_variant_class(name)
    assert issubclass(cls, Variant) and cls.name == name
    assert cls.supports_causal or cls.supports_bidirectional
    assert cls.time_complexity.startswith("O(") and cls.memory_complexity.startswith("O(")
    if not cls.exact:
        assert cls.error_bound is not None and cls.error_bound > 0, "approximate variants state an error_bound"
    for pname, spec in cls.params.items():
        assert isinstance(spec, Param), pname
        spec.validate(name, pname, spec.default)  # defaults are valid
    cls()  # default construction works
    info = cls.describe()
    assert info["name"] == name and set(info["params"]) == set(cls.params)


@pytest.mark.parametrize("name", VARIANTS)
def test_bad_parameters_fail_at_configure_naming_the_parameter(name):
    cls = get_variant_class(name)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    with pytest.raises(VariantParameterError, match="no parameter 'not_a_parameter'"):
        configure(config, name, not_a_parameter=1)
    for pname, spec in cls.params.items():
        bad = _invalid_value(spec)
        if bad is _NONE:
            continue
        with pytest.raises(VariantParameterError, match=f"'{pname}'"):
            configure(copy.deepcopy(config), name, **{pname: bad})


_NONE = object()


def _invalid_value(spec: Param):
    if spec.choices is not None:
        return "__not_a_choice__"
    if spec.min is not None:
        return spec.min - 1
    if spec.max is not None:
        return spec.max + 1
    if spec.type in (int, float):
        return "not a number"
    return _NONE


# ------------------------------------------------------------------------------------------------------
# kernel behaviour


@pytest.mark.parametrize("name", VARIANTS)
def test_shape_and_dtype(name):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, v, mask = make_inputs()
        out = run_variant(variant, q, k, v, make_call(causal, mask, variant=variant))
        assert out.shape == q.shape and out.dtype == q.dtype
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("padding", ["right", "left"])
def test_padded_tokens_never_change_real_outputs(name, padding):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, v, mask = make_inputs(padding=padding)
        out = run_variant(variant, q, k, v, make_call(causal, mask, variant=variant))
        pad = ~mask[:, None, :, None]
        noisy = [x.masked_fill(pad, 0.0) + torch.randn_like(x) * 100 * pad for x in (q, k, v)]
        out_noisy = run_variant(variant, *noisy, make_call(causal, mask, variant=variant))
        torch.testing.assert_close(real_rows(out_noisy, mask), real_rows(out, mask), atol=ATOL, rtol=1e-4)
        assert (out[pad.expand_as(out)] == 0).all(), "padded query rows must be zero"


def _padding_amount_invariant(name: str) -> bool:
    return get_variant_class(name).padding_amount_invariant


@pytest.mark.parametrize("name", variants_where(_padding_amount_invariant))
def test_outputs_do_not_depend_on_the_amount_of_padding(name):
    """A row's real outputs are the same alone and padded by 37 tokens in a longer batch (left when causal, right when
    bidirectional): enough to change the block count of every built-in pattern at its test_params."""
    require(_padding_amount_invariant, name)
    assert_invariant_to_padding_amount(make_variant(name))


@pytest.mark.parametrize("name", variants_where(_causal))
def test_causal_mode_leaks_no_future_token(name):
    require(_causal, name)
    variant = make_variant(name)
    q, k, v, mask = make_inputs(padding=None)
    out = run_variant(variant, q, k, v, make_call(True, variant=variant))
    for t in (1, N // 3, N - 1):
        future = torch.zeros(1, 1, N, 1, dtype=torch.bool)
        future[..., t:, :] = True
        changed = [torch.where(future, torch.randn_like(x) * 10, x) for x in (q, k, v)]
        out_changed = run_variant(variant, *changed, make_call(True, variant=variant))
        torch.testing.assert_close(out_changed[..., :t, :], out[..., :t, :], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", VARIANTS)
def test_matches_reference_restricted_to_its_pattern(name):
    variant = make_variant(name)
    for causal in modes(name):
        for seed, padding in ((0, "right"), (1, None)):
            q, k, v, mask = make_inputs(seed, padding=padding)
            call = make_call(causal, mask, variant=variant)
            out = run_variant(variant, q, k, v, call)
            ref = reference(variant, q, k, v, call)
            assert_matches_reference(variant, real_rows(out, mask), real_rows(ref, mask))


@pytest.mark.parametrize("name", VARIANTS)
def test_gradients_are_finite_and_match_the_reference(name):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, v, mask = make_inputs(2)
        grad_out = torch.randn_like(q)
        grads, outs = [], []
        for fn in (run_variant, None):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            call = make_call(causal, mask, variant=variant)
            out = run_variant(variant, *leaves, call) if fn else reference(variant, *leaves, call)
            (out * grad_out).sum().backward()
            grads.append([x.grad for x in leaves])
            outs.append(out.detach())
        for i, got in enumerate(grads[0]):
            if got is None:  # an input the kernel does not use (reformer: the keys are the queries) must not matter
                changed = [torch.randn_like(x) if j == i else x for j, x in enumerate((q, k, v))]
                out = run_variant(variant, *changed, make_call(causal, mask, variant=variant))
                torch.testing.assert_close(out, outs[0], msg=lambda m, w="qkv"[i]: f"{name}: no gradient for {w}: {m}")
                continue
            assert torch.isfinite(got).all(), f"{name}: non-finite gradient"
        if variant.exact:
            for got, want, which in zip(grads[0], grads[1], "qkv", strict=True):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3, msg=lambda m, w=which: f"d{w}: {m}")


@pytest.mark.parametrize("name", VARIANTS)
def test_bf16_runs_without_nan(name):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, v, mask = make_inputs(3, dtype=torch.bfloat16)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = run_variant(variant, *leaves, make_call(causal, mask, variant=variant, dtype=torch.bfloat16))
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        out.float().sum().backward()
        assert all(x.grad is None or torch.isfinite(x.grad).all() for x in leaves)  # None: an unused input
        ref = run_variant(variant, *(x.float() for x in (q, k, v)), make_call(causal, mask, variant=variant))
        assert relative_error(out.float(), ref) < 0.05


def _autocast_cases() -> list:
    """(variant, family): each causal variant in every rotary GQA decoder family, the others in BERT."""
    return [
        pytest.param(name, family, id=f"{name}-{family}")
        for name in VARIANTS
        for family in (("llama", "mistral", "qwen2") if _causal(name) else ("bert",))
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("name", "family"), _autocast_cases())
def test_runs_under_autocast(name, family, dtype):
    """Mixed precision as Trainer(bf16=True) runs it: the plug brings q/k/v (fp32 q/k from the rotary embedding,
    bf16 v) to one dtype; no NaN, and the logits stay within the stated tolerance of fp32."""
    assert_runs_under_autocast(name, family, dtype)


@pytest.mark.parametrize("name", VARIANTS)
def test_eval_is_deterministic(name):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, v, mask = make_inputs(4)
        first = run_variant(variant, q, k, v, make_call(causal, mask, variant=variant))
        second = run_variant(variant, q, k, v, make_call(causal, mask, variant=variant))
        assert torch.equal(first, second)


@pytest.mark.parametrize("name", VARIANTS)
def test_attention_dropout_is_applied_or_refused(name):
    variant = make_variant(name)
    causal = modes(name)[0]
    q, k, v, mask = make_inputs(5)
    call = make_call(causal, mask, dropout=0.5, training=True, variant=variant)
    if not variant.supports_dropout:
        with pytest.raises(ValueError, match="dropout"):
            run_variant(variant, q, k, v, call)
        return
    torch.manual_seed(0)
    dropped = run_variant(variant, q, k, v, call)
    plain = run_variant(variant, q, k, v, make_call(causal, mask, training=True, variant=variant))
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, plain)


# ------------------------------------------------------------------------------------------------------
# what the variant declares about memory


@pytest.mark.parametrize("name", variants_where(_subquadratic))
def test_declared_subquadratic_memory_allocates_no_quadratic_tensor(name):
    """A variant whose ``memory_complexity`` is below O(n²) allocates no tensor of n²/8 elements or more at
    n = 4096 (one head, a padded row), forward and backward, in each mode. At its default parameters: those are
    what the declaration describes (``test_params`` are sized for the suite's n = 100)."""
    require(_subquadratic, name)
    assert_memory_below_quadratic(get_variant_class(name)(), MEMORY_CHECK_LENGTH)


# ------------------------------------------------------------------------------------------------------
# inside real transformers models


@pytest.mark.parametrize("name", variants_where(_bidirectional))
@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_runs_in_encoders_with_padding_and_reloads_identically(name, family):
    require(_bidirectional, name)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(tiny_model_config(family, name)).eval()
    ids, mask = model_inputs()
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    ids_noisy = ids.clone()
    ids_noisy[1, REAL_LENGTH:] = 7
    out_noisy = model(input_ids=ids_noisy, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out_noisy[real], out[real], atol=1e-5, rtol=1e-4)
    model.train()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    reloaded = assert_reloads_identically(model, {"input_ids": ids, "attention_mask": mask})
    assert variant_spec(reloaded.config)["variant"] == name


@pytest.mark.parametrize("name", variants_where(_causal))
def test_runs_in_llama_with_gqa_without_leaking_the_future(name):
    require(_causal, name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_model_config("llama", name)).eval()
    ids, mask = model_inputs()
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    changed = ids.clone()
    changed[:, 60:] = 5
    logits_changed = model(input_ids=changed, attention_mask=mask).logits
    torch.testing.assert_close(logits_changed[:, :60], logits[:, :60], atol=1e-5, rtol=1e-4)
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", variants_where(_has_weights))
def test_learned_weights_get_gradients_and_reload_identically(name):
    """Variants with learned per-layer weights (``make_module``, at their ``test_params``): the weights are model
    parameters, every one gets a gradient, and a trained model saves and reloads them (and its outputs) exactly."""
    require(_has_weights, name)
    family = "bert" if get_variant_class(name).supports_bidirectional else "llama"
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(tiny_model_config(family, name))
    ids, mask = model_inputs()
    assert_weights_train_and_reload(model, {"input_ids": ids, "attention_mask": mask})


# ------------------------------------------------------------------------------------------------------
# decoding


@pytest.mark.parametrize("name", variants_where(_causal))
def test_cached_greedy_decoding_equals_the_full_forward(name):
    """Left-padded batch, prompts longer than any window: the variant's cache and decoding path read the keys its
    pattern reaches (or the variant refuses a cache, and generate with it)."""
    require(_causal, name)
    assert_decodes_like_the_full_forward(name)


@pytest.mark.parametrize("name", variants_where(_bounded_decoder))
def test_bounded_cache_holds_the_same_bytes_at_any_prompt_length(name):
    require(_bounded_decoder, name)
    assert_cache_bytes_bounded(name)
