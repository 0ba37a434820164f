"""What is specific to ``longformer`` (the contract suite covers the rest): equality with transformers' own
LongformerSelfAttention, per-layer windows, dilation, lengths that are multiples of nothing, short inputs
never padded up to the window, the per-batch ``global_attention_mask`` through a BERT model, causal
global tokens, KV-cache decoding, and no n x n intermediate."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.longformer.modeling_longformer import LongformerSelfAttention
from zoo.variants.longformer import LongformerAttention

import zoo
from zoo import testing
from zoo.plug.dispatch import run_variant
from zoo.testing import LargestAllocation, assert_memory_below_quadratic, reference
from zoo.variant import AttentionCall, VariantParameterError

HIDDEN, HEADS = 32, 4
HEAD_DIM = HIDDEN // HEADS


def make_call(causal=False, padding_mask=None, **kwargs) -> AttentionCall:
    return testing.make_call(causal, padding_mask, head_dim=HEAD_DIM, **kwargs)


def qkv(batch: int, n: int, seed: int = 0, heads: int = HEADS, head_dim: int = HEAD_DIM):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, head_dim, generator=gen) for _ in range(3)]


def padding(batch: int, n: int, real_in_last_row: int) -> torch.Tensor:
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[-1, real_in_last_row:] = False
    return mask


# --------------------------------------------------------------------------------------------------
# transformers' LongformerSelfAttention


def transformers_longformer(window: int, seed: int = 0) -> LongformerSelfAttention:
    config = transformers.LongformerConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, attention_window=[window], attention_probs_dropout_prob=0.0
    )
    torch.manual_seed(seed)
    module = LongformerSelfAttention(config, layer_id=0).eval()
    for name in ("query", "key", "value"):  # global projections = local ones (what the zoo variant uses)
        getattr(module, f"{name}_global").load_state_dict(getattr(module, name).state_dict())
    return module


def transformers_output(module, hidden, real, is_global, window):
    """Run transformers' module on inputs padded to a window multiple with its -1/0/+1 mask convention."""
    extra = (-hidden.shape[1]) % window
    hidden = torch.nn.functional.pad(hidden, (0, 0, 0, extra))
    real, is_global = (torch.nn.functional.pad(m, (0, extra)) for m in (real, is_global))
    mask = torch.zeros(real.shape).masked_fill(is_global, 10000.0).masked_fill(~real, -10000.0)
    out = module(
        hidden,
        attention_mask=mask,
        is_index_masked=~real,
        is_index_global_attn=is_global,
        is_global_attn=bool(is_global.any()),
    )[0]
    return out[:, : hidden.shape[1] - extra]


def zoo_output(module, hidden, real, global_attention_mask, window):
    batch, n, _ = hidden.shape
    q, k, v = (
        getattr(module, p)(hidden).view(batch, n, HEADS, HEAD_DIM).transpose(1, 2) for p in ("query", "key", "value")
    )
    call = make_call(padding_mask=real, extra={"global_attention_mask": global_attention_mask})
    out = run_variant(LongformerAttention(window=window, global_tokens=[]), q, k, v, call)
    return out.transpose(1, 2).reshape(batch, n, HIDDEN)


@pytest.mark.parametrize(
    "n, window, globals_",
    [
        (100, 16, [(0, 0), (0, 37), (1, 5)]),  # n not a multiple of the window; globals differ per row
        (96, 32, [(0, 40), (0, 45), (1, 95)]),  # a global key inside another global's window
        (64, 16, []),  # no global token: the pure band
        (20, 512, [(0, 3)]),  # short input: transformers pads 20 -> 512, the zoo does not
    ],
)
def test_equals_transformers_longformer_self_attention(n, window, globals_):
    module = transformers_longformer(window)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, n, HIDDEN, generator=gen, requires_grad=True)
    real = padding(2, n, n - n // 4)
    is_global = torch.zeros(2, n, dtype=torch.bool)
    for row, pos in globals_:
        is_global[row, pos] = True
    is_global &= real
    want = transformers_output(module, hidden, real, is_global, window)
    got = zoo_output(module, hidden, real, is_global.long(), window)
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)
    grad_out = torch.randn(got.shape, generator=gen) * real[..., None]
    (want_grad,) = torch.autograd.grad((want * grad_out).sum(), hidden)
    (got_grad,) = torch.autograd.grad((got * grad_out).sum(), hidden)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------------
# the kernel against its pattern


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dilation", [2, 3])
def test_dilation_with_globals_and_padding_matches_the_pattern(causal, dilation):
    variant = LongformerAttention(window=10, dilation=dilation, global_tokens=[0, 50])
    leaves = [x.requires_grad_() for x in qkv(2, 101)]
    call = make_call(causal, padding(2, 101, 77))
    out, ref = run_variant(variant, *leaves, call), reference(variant, *leaves, call)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad((out * grad_out).sum(), leaves)
    want = torch.autograd.grad((ref * grad_out).sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, window", [(129, 64), (300, 64), (300, 512), (1000, 100)])
def test_lengths_that_are_multiples_of_nothing(n, window, causal):
    variant = LongformerAttention(window=window, global_tokens=[3])
    q, k, v = qkv(2, n)
    call = make_call(causal, padding(2, n, n - 17))
    torch.testing.assert_close(
        run_variant(variant, q, k, v, call), reference(variant, q, k, v, call), atol=1e-5, rtol=1e-4
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 7, 100])
def test_short_inputs_are_never_padded_to_the_window(n, causal):
    variant = LongformerAttention(window=512)
    q, k, v = qkv(2, n)
    call = make_call(causal, padding(2, n, max(1, n - 3)))
    with LargestAllocation() as seen:
        out = run_variant(variant, q, k, v, call)
    torch.testing.assert_close(out, reference(variant, q, k, v, call), atol=1e-5, rtol=1e-4)
    assert seen.longest_dim <= max(n + 1, HEAD_DIM), f"n={n}: a tensor of length {seen.longest_dim} was built"


def test_per_layer_window_list():
    variant = LongformerAttention(window=[8, 32], global_tokens=[])
    q, k, v = qkv(1, 90)
    outs = []
    for layer, window in ((0, 8), (1, 32), (2, 8)):  # a list shorter than the model cycles
        call = make_call(layer_idx=layer)
        outs.append(run_variant(variant, q, k, v, call))
        single = LongformerAttention(window=window, global_tokens=[])
        torch.testing.assert_close(outs[-1], reference(single, q, k, v, call), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(outs[0], outs[1])


def tiny_longformer_bert(**params) -> transformers.PreTrainedModel:
    """A 2-layer BERT on `longformer` with ``params``, the same weights for the same call (seed 0), in eval mode."""
    config = transformers.BertConfig(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                                     intermediate_size=64, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(zoo.configure(config, "longformer", **params)).eval()


def test_per_layer_windows_inside_bert():
    ids = torch.randint(3, 64, (1, 80), generator=torch.Generator().manual_seed(0))
    mixed, narrow = (tiny_longformer_bert(window=w)(input_ids=ids, output_hidden_states=True).hidden_states
                     for w in ([8, 32], [8, 8]))
    torch.testing.assert_close(mixed[1], narrow[1])  # layer 0 uses window 8 in both
    assert not torch.allclose(mixed[2], narrow[2])  # layer 1 uses 32 in the first


# --------------------------------------------------------------------------------------------------
# global tokens


def test_global_attention_mask_reaches_the_kernel_through_bert():
    model = tiny_longformer_bert(window=8, global_tokens=[])
    ids = torch.randint(3, 64, (2, 70), generator=torch.Generator().manual_seed(0))
    per_batch = torch.zeros(2, 70, dtype=torch.long)
    per_batch[0, 40] = 1  # a question token in the first row only
    plain = model(input_ids=ids).last_hidden_state
    marked = model(input_ids=ids, global_attention_mask=per_batch).last_hidden_state
    assert not torch.allclose(marked[0], plain[0])
    torch.testing.assert_close(marked[1], plain[1])
    fixed = tiny_longformer_bert(window=8, global_tokens=[40])
    torch.testing.assert_close(marked[0], fixed(input_ids=ids[:1]).last_hidden_state[0], atol=1e-5, rtol=1e-4)


def test_global_tokens_default_by_mode_and_count_from_the_first_real_token():
    variant = LongformerAttention()
    n = 10
    assert variant.global_mask(make_call(causal=False), n).nonzero().tolist() == [[0, 0]]
    assert variant.global_mask(make_call(causal=True), n) is None
    left_padded = torch.ones(1, n, dtype=torch.bool)
    left_padded[0, :3] = False
    # the first real token of a left-padded row is global (global_tokens count from each row's first real token)
    assert variant.global_mask(make_call(padding_mask=left_padded), n).nonzero().tolist() == [[0, 3]]
    no_row_start = make_call(padding_mask=left_padded, row_start=None)  # position 0 is padding: never global
    assert variant.global_mask(no_row_start, n) is None
    assert LongformerAttention(global_tokens=[2, 500]).global_mask(make_call(), n).nonzero().tolist() == [[0, 2]]


def test_causal_global_tokens_see_the_past_and_are_seen_only_by_the_future():
    variant = LongformerAttention(window=8, global_tokens=[10])
    q, k, v = qkv(1, 60)
    out = run_variant(variant, q, k, v, make_call(causal=True))
    changed = [x.clone() for x in (q, k, v)]
    for x in changed:
        x[..., 11:, :] += 5.0
    out_changed = run_variant(variant, *changed, make_call(causal=True))
    torch.testing.assert_close(out_changed[..., :11, :], out[..., :11, :])  # the global token sees no future
    v_global = v.clone()
    v_global[..., 10, :] += 5.0
    out_global = run_variant(variant, q, k, v_global, make_call(causal=True))
    torch.testing.assert_close(out_global[..., :10, :], out[..., :10, :])  # nobody sees a future global token
    assert not torch.allclose(out_global[..., 50, :], out[..., 50, :])  # position 50 sees it, far outside its band


def test_global_attention_mask_of_the_wrong_shape_is_a_clear_error():
    q, k, v = qkv(2, 30)
    call = make_call(extra={"global_attention_mask": torch.ones(2, 31)})
    with pytest.raises(ValueError, match=r"global_attention_mask must be a \(batch, seq_len\) tensor"):
        run_variant(LongformerAttention(window=8), q, k, v, call)


@pytest.mark.parametrize("value", [{"window": 0}, {"window": [8, 1]}, {"dilation": 0}, {"global_tokens": [-1]}])
def test_bad_parameters_name_themselves(value):
    with pytest.raises(VariantParameterError, match=repr(next(iter(value)))):
        LongformerAttention(**value)


# --------------------------------------------------------------------------------------------------
# decoding with a KV cache, memory


def test_decoding_with_a_kv_cache_equals_the_full_forward():
    variant = LongformerAttention(window=12, dilation=2, global_tokens=[0, 30])
    q, k, v = qkv(2, 64)
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[1, :9] = False  # left padding, as in batched generation
    full = run_variant(variant, q, k, v, make_call(True, mask))
    for last in (1, 5):
        step = run_variant(variant, q[..., -last:, :], k, v, make_call(True, mask))
        torch.testing.assert_close(step, full[..., -last:, :], atol=1e-5, rtol=1e-4)


def test_llama_generation_with_cache_equals_generation_without():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        intermediate_size=64,
        pad_token_id=0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(zoo.configure(config, "longformer", window=8)).eval()
    ids = torch.randint(3, 64, (1, 30), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_no_n_by_n_intermediate_at_4096():
    """A smaller window than the contract suite's default one, with the per-batch global_attention_mask too."""
    n = 4096
    every_512th = torch.zeros(1, n, dtype=torch.long)
    every_512th[0, ::512] = 1
    assert_memory_below_quadratic(LongformerAttention(window=256), n, extra={"global_attention_mask": every_512th})


def test_flops_are_linear_in_n():
    variant = LongformerAttention()
    ratio = variant.flops(16384, 12, 64) / variant.flops(8192, 12, 64)
    assert 1.9 < ratio < 2.1
    assert variant.flops(16384, 12, 64) < LongformerAttention.__mro__[1].flops(variant, 16384, 12, 64) / 10
