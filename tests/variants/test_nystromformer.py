"""What is specific to ``nystromformer`` (the contract suite covers the rest): equality with transformers'
NystromformerSelfAttention (same weights, n == segment_means_seq_len, with and without the convolution), landmarks
over real tokens only, segments without landmarks leaving the inverse on the real ones, the iterative inverse
against torch's pseudo-inverse, the error against softmax shrinking with more landmarks, no n x n intermediate,
and clear errors."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.nystromformer.modeling_nystromformer import NystromformerSelfAttention
from zoo.variants.nystromformer import NystromformerAttention, ValueConvolution, iterative_pinv, segment_averaging

import zoo
from zoo.contract import LargestAllocation
from zoo.ops import softmax_attention
from zoo.plug.dispatch import run_variant
from zoo.variant import AttentionCall, VariantParameterError

HEADS, DIM = 2, 16


def qkv(n: int, batch: int = 2, heads: int = HEADS, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, DIM, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3)]


def call(mask=None, weights=None, scaling: float = DIM**-0.5) -> AttentionCall:
    return AttentionCall(causal=False, scaling=scaling, padding_mask=mask, weights=weights)


def relative_error(out, ref) -> float:
    return float((out - ref).norm() / ref.norm())


def segment_means(q, k, real, num_landmarks: int):
    averaging, has = segment_averaging(real, num_landmarks, q.dtype)
    return averaging @ q, averaging @ k, has


# -- transformers' semantics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("conv_kernel_size", [None, 5])
@pytest.mark.parametrize("num_landmarks", [8, 64])  # 64 = n: transformers (and the zoo) use full softmax there
def test_equals_transformers_nystromformer_self_attention(num_landmarks, conv_kernel_size):
    n, hidden = 64, HEADS * DIM
    config = transformers.NystromformerConfig(
        hidden_size=hidden, num_attention_heads=HEADS, num_landmarks=num_landmarks, segment_means_seq_len=n,
        conv_kernel_size=conv_kernel_size or 3, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    theirs = NystromformerSelfAttention(config).eval()
    if conv_kernel_size is None:  # the config's field is an int; the layer checks its attribute for None
        theirs.conv_kernel_size = None
    hidden_states = torch.randn(2, n, hidden)
    want = theirs(hidden_states)[0]

    variant = NystromformerAttention(num_landmarks=num_landmarks, conv_kernel_size=conv_kernel_size)
    weights = None
    if conv_kernel_size is not None:
        weights = ValueConvolution(HEADS, conv_kernel_size)
        weights.load_state_dict(theirs.state_dict(), strict=False)  # the same name: conv.weight
        assert torch.equal(weights.conv.weight, theirs.conv.weight)
    q, k, v = (proj(hidden_states).view(2, n, HEADS, DIM).transpose(1, 2)
               for proj in (theirs.query, theirs.key, theirs.value))
    got = run_variant(variant, q, k, v, call(weights=weights)).transpose(1, 2).reshape(2, n, hidden)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_iterative_inverse_approaches_the_pseudo_inverse():
    q = torch.randn(2, HEADS, 32, DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kernel = torch.softmax(q @ q.transpose(-1, -2), -1)  # condition number ≈ 10: 6 iterations converge
    errors = [relative_error(iterative_pinv(kernel, it), torch.linalg.pinv(kernel)) for it in (2, 6, 12)]
    assert errors[0] > errors[1] > errors[2] and errors[1] < 1e-4, errors


# -- any n, padding -------------------------------------------------------------------------------------------


def test_landmarks_are_means_of_the_real_tokens_of_each_segment():
    q, k, _ = qkv(12, batch=1)
    real = torch.tensor([[True] * 6 + [False] * 6])
    q_landmarks, k_landmarks, has = segment_means(q, k, real, num_landmarks=4)  # segments of 3 tokens
    assert has.tolist() == [[True, True, False, False]]
    torch.testing.assert_close(q_landmarks[..., 0, :], q[..., 0:3, :].mean(-2))
    torch.testing.assert_close(k_landmarks[..., 1, :], k[..., 3:6, :].mean(-2))
    real = torch.tensor([[True] * 4 + [False] * 8])
    q_landmarks, _, has = segment_means(q, k, real, num_landmarks=4)
    torch.testing.assert_close(q_landmarks[..., 1, :], q[..., 3, :])  # one real token in the second segment
    assert has.tolist() == [[True, True, False, False]]


def test_segments_split_any_length_evenly():
    q, k, _ = qkv(10, batch=1)
    q_landmarks, _, has = segment_means(q, k, torch.ones(1, 10, dtype=torch.bool), num_landmarks=4)
    assert has.all()  # segments [0, 3), [3, 5), [5, 8), [8, 10): every landmark has tokens
    for j, (start, stop) in enumerate([(0, 3), (3, 5), (5, 8), (8, 10)]):
        torch.testing.assert_close(q_landmarks[..., j, :], q[..., start:stop, :].mean(-2))


def test_segments_without_landmarks_leave_the_inverse_to_the_real_ones():
    """Right padding empties the last segments: the result is Nyström over the real landmarks alone."""
    n, real_length, m = 60, 25, 10  # segments of 6 tokens: 5 real landmarks (the last one from a single token)
    q, k, v = qkv(n, batch=1, dtype=torch.float64)
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, :real_length] = True
    got = run_variant(NystromformerAttention(num_landmarks=m), q, k, v, call(mask))

    scale = (DIM**-0.5) ** 0.5
    qs, ks, vr = q[..., :real_length, :] * scale, k[..., :real_length, :] * scale, v[..., :real_length, :]
    q_landmarks = torch.stack([qs[..., i : i + 6, :].mean(-2) for i in range(0, real_length, 6)], -2)
    k_landmarks = torch.stack([ks[..., i : i + 6, :].mean(-2) for i in range(0, real_length, 6)], -2)
    kernel_1 = torch.softmax(qs @ k_landmarks.transpose(-1, -2), -1)
    kernel_2 = torch.softmax(q_landmarks @ k_landmarks.transpose(-1, -2), -1)
    kernel_3 = torch.softmax(q_landmarks @ ks.transpose(-1, -2), -1)
    want = kernel_1 @ iterative_pinv(kernel_2, 6) @ kernel_3 @ vr
    torch.testing.assert_close(got[..., :real_length, :], want)
    assert (got[..., real_length:, :] == 0).all()


def test_short_inputs_are_softmax_attention():
    q, k, v = qkv(20)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 15:] = False
    got = run_variant(NystromformerAttention(num_landmarks=32), q, k, v, call(mask))
    want = softmax_attention(q, k, v, mask[:, None, None, :], DIM**-0.5).masked_fill(~mask[:, None, :, None], 0)
    torch.testing.assert_close(got, want)


def test_a_batch_row_of_padding_only_gives_zeros_and_finite_gradients():
    q, k, v = (x.requires_grad_() for x in qkv(50))
    mask = torch.ones(2, 50, dtype=torch.bool)
    mask[1] = False
    out = run_variant(NystromformerAttention(num_landmarks=8), q, k, v, call(mask))
    out.square().sum().backward()
    assert (out[1] == 0).all() and all(torch.isfinite(x.grad).all() for x in (q, k, v))


# -- accuracy -----------------------------------------------------------------------------------------------


def test_error_against_softmax_shrinks_with_more_landmarks():
    q, k, v = qkv(256, seed=1)
    want = softmax_attention(q, k, v, None, DIM**-0.5)
    errors = [relative_error(run_variant(NystromformerAttention(num_landmarks=m), q, k, v, call()), want)
              for m in (8, 32, 128)]
    assert errors[0] > errors[1] > errors[2], errors


@pytest.mark.parametrize("params", [{}, {"num_landmarks": 16}])
def test_error_bound_holds_at_the_defaults_and_without_the_convolution(params):
    """The contract checks ``error_bound`` at ``test_params`` (with a convolution, which both sides share);
    without it, against plain softmax, the bound holds too: at the defaults (64 landmarks) and at 16."""
    variant = NystromformerAttention(**params)
    errors = []
    for seed in range(6):
        for padded in (False, True):
            q, k, v = qkv(100, seed=seed)
            mask = torch.ones(2, 100, dtype=torch.bool)
            if padded:
                mask[1, 73:] = False
            out = run_variant(variant, q, k, v, call(mask))
            want = softmax_attention(q, k, v, mask[:, None, None, :], DIM**-0.5).masked_fill(~mask[:, None, :, None], 0)
            errors.append(relative_error(out, want))
    assert max(errors) <= (NystromformerAttention.error_bound if params == {} else 0.8), errors


# -- cost and errors ----------------------------------------------------------------------------------------


def test_no_allocation_of_n_squared_over_8_at_4096():
    n = 4096
    q, k, v = (x.requires_grad_() for x in qkv(n, batch=1, heads=1))
    weights = ValueConvolution(1, 65)
    with LargestAllocation() as probe:
        NystromformerAttention(conv_kernel_size=65).attend(q, k, v, call(weights=weights)).sum().backward()
    assert 0 < probe.largest < n * n // 8, f"largest allocation {probe.largest} elements (n²/8 = {n * n // 8})"


def test_even_convolution_and_causal_use_are_refused():
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    with pytest.raises(VariantParameterError, match="'conv_kernel_size' = 4 must be odd"):
        zoo.configure(config, "nystromformer", conv_kernel_size=4)
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match="does not support causal"):
        run_variant(NystromformerAttention(), q, k, v, AttentionCall(causal=True, scaling=0.25))
