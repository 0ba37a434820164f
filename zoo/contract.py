"""The variant contract suite: pytest tests parametrized over every registered variant, plugins included.

Run it on the installed variants (the project's tests import it) or on your own plugin::

    pytest --pyargs zoo.contract -k my_variant

Each kernel is called through the same plumbing transformers uses (:func:`zoo.hf.run_variant`) on small
inputs (batch 2, 2 heads, n=100, head_dim 16, q/k/v ~ N(0, 1), the second row padded) built with the
variant's ``test_params``. Exact variants must equal their reference -- softmax attention restricted to
their own pattern -- within 1e-5 in fp32; approximate ones must stay within their ``error_bound``.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import zoo
from zoo.hf import run_variant
from zoo.ops import allowed_mask, softmax_attention
from zoo.registry import get_variant_class, list_variants
from zoo.variant import AttentionCall, Param, Variant, VariantParameterError

BATCH, HEADS, N, HEAD_DIM = 2, 2, 100, 16
REAL_LENGTH = 73  # real tokens in the second (right-padded) row
ATOL = 1e-5

VARIANTS = list_variants()


def make_variant(name: str, **overrides) -> Variant:
    cls = get_variant_class(name)
    return cls(**{**cls.test_params, **overrides})


def modes(name: str) -> list[bool]:
    cls = get_variant_class(name)
    return [c for c, ok in ((False, cls.supports_bidirectional), (True, cls.supports_causal)) if ok]


def make_inputs(seed: int = 0, dtype=torch.float32, n: int = N, padding: str | None = "right"):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=gen).to(dtype) for _ in range(3))
    mask = None
    if padding is not None:
        mask = torch.ones(BATCH, n, dtype=torch.bool)
        if padding == "right":
            mask[1, REAL_LENGTH:] = False
        else:
            mask[1, : n - REAL_LENGTH] = False
    return q, k, v, mask


def make_call(causal: bool, padding_mask=None, **kwargs) -> AttentionCall:
    return AttentionCall(causal=causal, scaling=HEAD_DIM**-0.5, padding_mask=padding_mask, **kwargs)


def reference(variant: Variant, q, k, v, call: AttentionCall) -> torch.Tensor:
    """What the kernel must equal (exact) or approximate: the variant's own ``reference`` if it defines
    one, else softmax attention restricted to its pattern, causality and padding (O(n²), tests only)."""
    if hasattr(variant, "reference"):
        out = variant.reference(q, k, v, call)
    else:
        pattern = variant.pattern(call, q.shape[-2], k.shape[-2])
        allowed = allowed_mask(call, pattern, q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])
        out = softmax_attention(q, k, v, allowed, call.scaling)
    if call.padding_mask is not None:
        out = out.masked_fill(~call.padding_mask[:, None, :, None], 0.0)
    return out


def real_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Outputs at real (unpadded) query positions, flattened, for comparisons."""
    if mask is None:
        return x
    return x.transpose(1, 2)[mask]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).detach().norm() / ref.detach().norm())


def assert_matches_reference(variant: Variant, out, ref, what: str = "output") -> None:
    if variant.exact:
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4, msg=lambda m: f"{variant.name} {what}: {m}")
    else:
        err = relative_error(out, ref)
        assert err <= variant.error_bound, f"{variant.name}: relative {what} error {err:.4f} > {variant.error_bound}"


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage (in elements) any op produces, forward and backward: tests use it to
    show a sub-quadratic kernel never allocates anything of size n x n."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


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
        zoo.configure(config, name, not_a_parameter=1)
    for pname, spec in cls.params.items():
        bad = _invalid_value(spec)
        if bad is _NONE:
            continue
        with pytest.raises(VariantParameterError, match=f"'{pname}'"):
            zoo.configure(copy.deepcopy(config), name, **{pname: bad})


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
        out = run_variant(variant, q, k, v, make_call(causal, mask))
        assert out.shape == q.shape and out.dtype == q.dtype
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("padding", ["right", "left"])
def test_padded_tokens_never_change_real_outputs(name, padding):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, v, mask = make_inputs(padding=padding)
        out = run_variant(variant, q, k, v, make_call(causal, mask))
        pad = ~mask[:, None, :, None]
        noisy = [x.masked_fill(pad, 0.0) + torch.randn_like(x) * 100 * pad for x in (q, k, v)]
        out_noisy = run_variant(variant, *noisy, make_call(causal, mask))
        torch.testing.assert_close(real_rows(out_noisy, mask), real_rows(out, mask), atol=ATOL, rtol=1e-4)
        assert (out[pad.expand_as(out)] == 0).all(), "padded query rows must be zero"


@pytest.mark.parametrize("name", [n for n in VARIANTS if get_variant_class(n).supports_causal])
def test_causal_mode_leaks_no_future_token(name):
    variant = make_variant(name)
    q, k, v, mask = make_inputs(padding=None)
    out = run_variant(variant, q, k, v, make_call(True))
    for t in (1, N // 3, N - 1):
        future = torch.zeros(1, 1, N, 1, dtype=torch.bool)
        future[..., t:, :] = True
        changed = [torch.where(future, torch.randn_like(x) * 10, x) for x in (q, k, v)]
        out_changed = run_variant(variant, *changed, make_call(True))
        torch.testing.assert_close(out_changed[..., :t, :], out[..., :t, :], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", VARIANTS)
def test_matches_reference_restricted_to_its_pattern(name):
    variant = make_variant(name)
    for causal in modes(name):
        for seed, padding in ((0, "right"), (1, None)):
            q, k, v, mask = make_inputs(seed, padding=padding)
            call = make_call(causal, mask)
            out = run_variant(variant, q, k, v, call)
            ref = reference(variant, q, k, v, call)
            assert_matches_reference(variant, real_rows(out, mask), real_rows(ref, mask))


@pytest.mark.parametrize("name", VARIANTS)
def test_gradients_are_finite_and_match_the_reference(name):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, v, mask = make_inputs(2)
        grad_out = torch.randn_like(q)
        grads = []
        for fn in (run_variant, None):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            call = make_call(causal, mask)
            out = run_variant(variant, *leaves, call) if fn else reference(variant, *leaves, call)
            (out * grad_out).sum().backward()
            grads.append([x.grad for x in leaves])
        for got in grads[0]:
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
        out = run_variant(variant, *leaves, make_call(causal, mask))
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        out.float().sum().backward()
        assert all(torch.isfinite(x.grad).all() for x in leaves)
        ref = run_variant(variant, *(x.float() for x in (q, k, v)), make_call(causal, mask))
        assert relative_error(out.float(), ref) < 0.05


@pytest.mark.parametrize("name", VARIANTS)
def test_eval_is_deterministic(name):
    variant = make_variant(name)
    for causal in modes(name):
        q, k, v, mask = make_inputs(4)
        first = run_variant(variant, q, k, v, make_call(causal, mask))
        second = run_variant(variant, q, k, v, make_call(causal, mask))
        assert torch.equal(first, second)


@pytest.mark.parametrize("name", VARIANTS)
def test_attention_dropout_is_applied_or_refused(name):
    variant = make_variant(name)
    causal = modes(name)[0]
    q, k, v, mask = make_inputs(5)
    call = make_call(causal, mask, dropout=0.5, training=True)
    if not variant.supports_dropout:
        with pytest.raises(ValueError, match="dropout"):
            run_variant(variant, q, k, v, call)
        return
    torch.manual_seed(0)
    dropped = run_variant(variant, q, k, v, call)
    plain = run_variant(variant, q, k, v, make_call(causal, mask, training=True))
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, plain)


# ------------------------------------------------------------------------------------------------------
# inside real transformers models


def tiny_model_config(family: str, name: str) -> transformers.PretrainedConfig:
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if family == "bert":
        config = transformers.BertConfig(**common, attention_probs_dropout_prob=0.0, max_position_embeddings=256)
    elif family == "modernbert":
        config = transformers.ModernBertConfig(
            **common, attention_dropout=0.0, global_attn_every_n_layers=2, local_attention=16, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        )
    elif family == "llama":
        config = transformers.LlamaConfig(**common, num_key_value_heads=2, attention_dropout=0.0, pad_token_id=0)
    else:
        raise ValueError(family)
    return zoo.configure(config, name, **get_variant_class(name).test_params)


def _model_inputs(n: int = N):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (BATCH, n), generator=gen)
    mask = torch.ones(BATCH, n, dtype=torch.long)
    mask[1, REAL_LENGTH:] = 0
    return ids, mask


@pytest.mark.parametrize("name", [n for n in VARIANTS if get_variant_class(n).supports_bidirectional])
@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_runs_in_encoders_with_padding_and_reloads_identically(name, family):
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(tiny_model_config(family, name)).eval()
    ids, mask = _model_inputs()
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    ids_noisy = ids.clone()
    ids_noisy[1, REAL_LENGTH:] = 7
    out_noisy = model(input_ids=ids_noisy, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out_noisy[real], out[real], atol=1e-5, rtol=1e-4)
    model.train()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        reloaded = transformers.AutoModel.from_pretrained(tmp).eval()
    assert reloaded.config.attention_zoo["variant"] == name
    torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).last_hidden_state, out)


@pytest.mark.parametrize("name", [n for n in VARIANTS if get_variant_class(n).supports_causal])
def test_runs_in_llama_with_gqa_without_leaking_the_future(name):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_model_config("llama", name)).eval()
    ids, mask = _model_inputs()
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    changed = ids.clone()
    changed[:, 60:] = 5
    logits_changed = model(input_ids=changed, attention_mask=mask).logits
    torch.testing.assert_close(logits_changed[:, :60], logits[:, :60], atol=1e-5, rtol=1e-4)
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
