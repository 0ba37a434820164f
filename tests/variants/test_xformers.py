"""What is specific to ``xformers`` (the contract suite covers the rest, with window 16 on the torch path).

xformers 0.0.35 has no CPU operator, so on CPU these tests check the dispatch and its log, that the attention
biases we build encode exactly the intended pattern (``materialize()`` at tiny sizes), and the packing around
the kernel by running the xformers path with a stand-in kernel that applies the materialized bias. The real
kernel is tested against the dense reference by ``test_cuda_kernel_equals_the_dense_reference``, which needs
CUDA and xformers and is skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import logging
import types

import pytest
import torch
import transformers
import zoo.variants.xformers as xf

import zoo
from zoo import testing
from zoo.plug.dispatch import run_variant
from zoo.testing import assert_memory_below_quadratic
from zoo.variant import AttentionCall

HEADS, HEAD_DIM = 2, 8
HAS_CUDA_XFORMERS = torch.cuda.is_available() and importlib.util.find_spec("xformers") is not None


def make_call(causal=False, padding_mask=None, head_dim=HEAD_DIM, **kwargs) -> AttentionCall:
    return testing.make_call(causal, padding_mask, head_dim=head_dim, **kwargs)


def qkv(batch, n, dtype=torch.float32, device="cpu", heads=HEADS, head_dim=HEAD_DIM, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, head_dim, generator=gen).to(device, dtype).requires_grad_() for _ in range(3)]


def padding(kind: str, n: int, device="cpu") -> torch.Tensor | None:
    """Batch of 3: row 0 full, rows 1-2 padded as ``kind`` says."""
    if kind == "none":
        return None
    mask = torch.ones(3, n, dtype=torch.bool)
    if kind == "right":
        mask[1, n * 2 // 3 :] = False
        mask[2, n // 2 :] = False
    elif kind == "left":
        mask[1, : n // 3] = False
        mask[2, :1] = False
    else:  # holes, and an entirely padded row
        mask[1, n // 5 : n // 2] = False
        mask[2, :] = False
    return mask.to(device)


def reference(window, q, k, v, call):
    """Dense softmax attention under the variant's pattern, causality and padding; padded query rows zero."""
    return testing.reference(xf.XFormersAttention(window=window), q, k, v, call)


def zero_padded_rows(out, call):
    if call.padding_mask is None:
        return out
    return out.masked_fill(~call.padding_mask[:, None, :, None], 0.0)


def assert_same_output_and_gradients(out, ref, inputs, atol, grad_atol):
    grad = torch.randn_like(out)
    got = torch.autograd.grad((out * grad).sum(), inputs)
    want = torch.autograd.grad((ref * grad).sum(), inputs)
    torch.testing.assert_close(out, ref, atol=atol, rtol=1e-3)
    for g, w, name in zip(got, want, "qkv", strict=True):
        torch.testing.assert_close(g, w, atol=grad_atol, rtol=1e-2, msg=lambda m, name=name: f"d{name}: {m}")


def materialized_bias_attention(q, k, v, attn_bias=None, p=0.0, scale=None, calls=None):
    """Stand-in for memory_efficient_attention on CPU: (batch, seq, heads, dim) in and out, the bias applied
    through its ``materialize()``."""
    if calls is not None:
        calls.append(q.shape[1])
    scores = torch.einsum("bmhk,bnhk->bhmn", q, k) * scale
    if attn_bias is not None:
        scores = scores + attn_bias.materialize(scores.shape[-2:], dtype=scores.dtype)
    return torch.einsum("bhmn,bnhk->bmhk", scores.softmax(-1), v)


# ---------------------------------------------------------------------------------------------------------
# dispatch


def test_cpu_runs_torch_sdpa_with_one_info_log(caplog):
    xf.log_backend_once.cache_clear()
    q, k, v = (x.detach() for x in qkv(3, 40))
    with caplog.at_level(logging.INFO, logger="zoo.variants.xformers"):
        for _ in range(3):
            run_variant(xf.XFormersAttention(), q, k, v, make_call(True, padding("right", 40)))
    messages = [r.getMessage() for r in caplog.records if r.name == "zoo.variants.xformers"]
    assert len(messages) == 1, messages
    assert "torch scaled_dot_product_attention" in messages[0] and "cpu" in messages[0]


def test_availability_needs_cuda_and_an_importable_xformers(monkeypatch):
    cuda_like = types.SimpleNamespace(device=torch.device("cuda"))
    assert "CUDA" in xf.xformers_unavailable_reason(torch.zeros(1))
    assert xf.xformers_unavailable_reason(cuda_like) is None  # xformers 0.0.35 is installed and imports on CPU
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "not installed" in xf.xformers_unavailable_reason(cuda_like)


def test_a_kernel_without_an_operator_falls_back_and_says_why(monkeypatch, caplog):
    """The real xformers on CPU raises NotImplementedError (no operator): the call still succeeds, on torch."""
    xf.log_backend_once.cache_clear()
    monkeypatch.setattr(xf, "xformers_unavailable_reason", lambda q: None)
    q, k, v = (x.detach() for x in qkv(3, 30))
    call = make_call(False, padding("right", 30))
    with caplog.at_level(logging.INFO, logger="zoo.variants.xformers"):
        out = run_variant(xf.XFormersAttention(), q, k, v, call)
    torch.testing.assert_close(out, reference(None, q, k, v, call), atol=1e-5, rtol=1e-4)
    assert any("no operator" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------------------
# the biases we build


def packed_pattern(seqlens, causal, window):
    """Expected allowed (total, total) pattern of packed rows from each token's row and position in it."""
    row = torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens))
    pos = torch.cat([torch.arange(s) for s in seqlens])
    allowed = row[:, None] == row[None, :]
    offset = pos[:, None] - pos[None, :]
    if causal:
        allowed &= offset >= 0
    if window is not None:
        allowed &= offset.abs() < window
    return allowed


@pytest.mark.parametrize(
    "causal, window, expected",
    [(False, None, "BlockDiagonalMask"), (True, None, "BlockDiagonalCausalMask"),
     (True, 3, "BlockDiagonalCausalLocalAttentionMask")],
)
def test_packed_bias_is_block_diagonal_over_the_real_tokens(causal, window, expected):
    seqlens = [3, 5, 1, 4]
    bias = xf.xformers_bias(causal, window, seqlens=seqlens, device=torch.device("cpu"))
    assert type(bias).__name__ == expected
    total = sum(seqlens)
    assert bias.q_seqinfo.seqstart_py == [0, 3, 8, 9, 13] and bias.k_seqinfo.seqstart_py == [0, 3, 8, 9, 13]
    allowed = bias.materialize((total, total)) == 0  # 0 where allowed, -inf elsewhere
    assert torch.equal(allowed, packed_pattern(seqlens, causal, window))


def test_packed_bidirectional_window_is_not_a_packed_bias():
    with pytest.raises(xf.TorchPathNeeded, match="bidirectional local"):
        xf.xformers_bias(False, 3, seqlens=[3, 4])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_unpadded_bias_encodes_causality_and_the_window(causal, window):
    n = 9
    bias = xf.xformers_bias(causal, window, q_len=n, kv_len=n)
    if not causal and window is None:
        assert bias is None
        return
    allowed = bias.materialize((n, n)) == 0
    assert torch.equal(allowed, packed_pattern([n], causal, window))


def test_kv_cache_bias_aligns_the_queries_to_the_end():
    bias = xf.xformers_bias(True, None, q_len=2, kv_len=6)
    assert torch.equal(bias.materialize((2, 6)) == 0, torch.arange(6)[None, :] <= torch.tensor([[4], [5]]))
    bias = xf.xformers_bias(True, 2, q_len=2, kv_len=6)
    assert torch.equal(bias.materialize((2, 6)) == 0, torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]) == 1)


def test_xformers_kernels_take_a_bidirectional_window_only_in_half_precision():
    q, k, v = (x.detach() for x in qkv(1, 10))
    with pytest.raises(xf.TorchPathNeeded, match="fp16/bf16"):
        xf.xformers_attention(q, k, v, make_call(False), 4)


def test_packing_keeps_only_real_tokens_in_order_and_unpacks_to_zeros():
    x = torch.arange(3 * 1 * 6 * 1, dtype=torch.float32).view(3, 1, 6, 1)
    real = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    packed = xf.pack_real_tokens(x, real)
    assert packed.flatten().tolist() == [0, 1, 2, 3, 4, 5, 7, 9, 10]
    back = xf.unpack_real_tokens(packed, real, x.shape)
    assert torch.equal(back, x * real[:, None, :, None])


# ---------------------------------------------------------------------------------------------------------
# the xformers path around a stand-in kernel, and the torch path


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kind", ["none", "right", "left", "holes"])
def test_xformers_path_with_a_materialized_kernel_equals_the_reference(causal, window, kind):
    n = 23
    q, k, v = qkv(3, n, dtype=torch.float64)
    call = make_call(causal, padding(kind, n))
    calls = []

    def kernel(*args, **kwargs):
        return materialized_bias_attention(*args, **kwargs, calls=calls)

    if window is not None and kind == "holes":  # positions are not packed distances: the torch path takes it
        with pytest.raises(xf.TorchPathNeeded):
            xf.xformers_attention(q, k, v, call, window, attention=kernel)
        return
    out = zero_padded_rows(xf.xformers_attention(q, k, v, call, window, attention=kernel), call)
    assert_same_output_and_gradients(out, reference(window, q, k, v, call), (q, k, v), 1e-5, 1e-4)
    real = call.padding_mask
    if real is not None:  # no compute on pad tokens: the kernel only ever saw real tokens
        expected = [int(s) for s in real.sum(-1) if s > 0] if window is not None and not causal else [int(real.sum())]
        assert calls == expected


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 5, 200])
@pytest.mark.parametrize("kind", ["none", "right", "left", "holes"])
def test_torch_path_equals_the_reference(causal, window, kind):
    n = 37
    q, k, v = qkv(3, n)
    call = make_call(causal, padding(kind, n))
    out = run_variant(xf.XFormersAttention(window=window), q, k, v, call)
    assert_same_output_and_gradients(out, reference(window, q, k, v, call), (q, k, v), 1e-5, 1e-4)


def test_kv_cache_steps_equal_the_last_rows_of_the_full_forward():
    q, k, v = (x.detach() for x in qkv(3, 30))
    mask = padding("left", 30)
    for window in (None, 4):
        variant = xf.XFormersAttention(window=window)
        full = run_variant(variant, q, k, v, make_call(True, mask))
        step = run_variant(variant, q[:, :, -2:], k, v, make_call(True, mask))
        torch.testing.assert_close(step, full[:, :, -2:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 64])
def test_no_n_by_n_intermediate_at_4096_with_padding(window):
    """With and without a window (the contract suite checks the default, None), both modes, a padded batch."""
    assert_memory_below_quadratic(xf.XFormersAttention(window=window), batch=2)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_full_attention_in_models_equals_the_sdpa_baseline(family):
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if family == "bert":
        config = transformers.BertConfig(**common, attention_probs_dropout_prob=0.0)
    else:
        config = transformers.LlamaConfig(**common, num_key_value_heads=2, attention_dropout=0.0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(zoo.configure(config, "sdpa")).eval()
    ids = torch.randint(3, 64, (2, 50))
    mask = torch.ones(2, 50, dtype=torch.long)
    mask[1, 35:] = 0
    baseline = model(input_ids=ids, attention_mask=mask).last_hidden_state
    zoo.configure(model, "xformers")
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out[real], baseline[real], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# the real kernel (CUDA)


@pytest.mark.skipif(not HAS_CUDA_XFORMERS, reason="needs a CUDA device and xformers")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_kernel_equals_the_dense_reference(dtype, caplog):
    xf.log_backend_once.cache_clear()
    n, head_dim = 200, 64
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    with caplog.at_level(logging.INFO, logger="zoo.variants.xformers"):
        for causal in (False, True):
            for window in (None, 16):
                for kind in ("none", "right", "left", "holes"):
                    q, k, v = qkv(3, n, dtype=dtype, device="cuda", heads=4, head_dim=head_dim)
                    call = make_call(causal, padding(kind, n, "cuda"), head_dim=head_dim)
                    out = run_variant(xf.XFormersAttention(window=window), q, k, v, call)
                    ref = reference(window, *(x.float() for x in (q, k, v)), call)
                    assert_same_output_and_gradients(out.float(), ref, (q, k, v), tolerance, 5 * tolerance)
    messages = [r.getMessage() for r in caplog.records if r.name == "zoo.variants.xformers"]
    assert any("xformers memory_efficient_attention" in m for m in messages), messages
    fallbacks = [m for m in messages if "torch" in m]  # only a window over holes, or bidirectional in fp32
    assert all("not only a prefix or suffix" in m or "fp16/bf16" in m for m in fallbacks), fallbacks
