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
