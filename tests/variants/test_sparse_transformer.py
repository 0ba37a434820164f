"""What is specific to ``sparse_transformer`` (the contract suite covers the rest): the two patterns as the paper
defines them, the kernel against the dense reference for both patterns on both code paths (CPU flash kernels,
and the materialized path used off CPU and for float64), lengths that are multiples of nothing, short inputs,
padding with holes, KV-cache steps, no n x n intermediate, and the fixed pattern inside Llama with a reload."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from zoo.variants.sparse_transformer import SparseTransformerAttention

import zoo
from zoo import testing
from zoo.ops import allowed_mask, softmax_attention
from zoo.plug.dispatch import run_variant
from zoo.testing import assert_memory_below_quadratic, assert_reloads_identically, reference
from zoo.variant import AttentionCall, VariantParameterError

HEADS, HEAD_DIM = 2, 8


def make_call(causal=False, padding_mask=None, **kwargs) -> AttentionCall:
    return testing.make_call(causal, padding_mask, head_dim=HEAD_DIM, **kwargs)


def qkv(batch: int, n: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, HEADS, n, HEAD_DIM, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


def padding(kind: str, batch: int, n: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    mask = torch.ones(batch, n, dtype=torch.bool)
    if kind == "right":
        mask[1, n * 2 // 3 :] = False
    elif kind == "left":
        mask[1, : n // 3] = False
    else:  # holes, and a row with a single real token
        mask[1, n // 5 : n // 2] = False
        mask[2, 1:] = False
    return mask


def assert_same_output_and_gradients(variant, q, k, v, call, atol):
    out = run_variant(variant, q, k, v, call)
    ref = reference(variant, q, k, v, call)
    grad = torch.randn_like(out)
    got = torch.autograd.grad((out * grad).sum(), (q, k, v))
    want = torch.autograd.grad((ref * grad).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=atol, rtol=1e-4)
    for g, w, name in zip(got, want, "qkv", strict=True):
        torch.testing.assert_close(g, w, atol=10 * atol, rtol=1e-3, msg=lambda m, name=name: f"d{name}: {m}")


# ---------------------------------------------------------------------------------------------------------
# the spec


def paper_keys(pattern: str, i: int, n: int, stride: int, summary: int) -> set[int]:
    """The union of the paper's two heads for query i, written out with loops (bidirectional)."""
    if pattern == "strided":
        local = {j for j in range(n) if abs(i - j) < stride}
        columns = {j for j in range(n) if (i - j) % stride == 0}
        return local | columns
    block = {j for j in range(n) if j // stride == i // stride}
    summaries = {j for j in range(n) if j % stride >= stride - summary}
    return block | summaries


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
def test_pattern_is_the_union_of_the_papers_two_heads(pattern):
    n, stride, summary = 40, 6, 2
    variant = SparseTransformerAttention(layout=pattern, stride=stride, num_summary=summary)
    predicate = variant.pattern(make_call(), n, n)
    q_idx, kv_idx = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = predicate(None, None, q_idx, kv_idx)
    for i in range(n):
        assert set(mask[i].nonzero().flatten().tolist()) == paper_keys(pattern, i, n, stride, summary), i


def test_a_worked_example():
    strided = SparseTransformerAttention(layout="strided", stride=4).pattern(make_call(), 20, 20)
    keys = strided(None, None, torch.tensor(9), torch.arange(20)).nonzero().flatten().tolist()
    assert keys == [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 17]
    fixed = SparseTransformerAttention(layout="fixed", stride=4, num_summary=1).pattern(make_call(), 20, 20)
    keys = fixed(None, None, torch.tensor(9), torch.arange(20)).nonzero().flatten().tolist()
    assert keys == [3, 7, 8, 9, 10, 11, 15, 19]


def test_num_summary_larger_than_the_stride_is_refused():
    with pytest.raises(VariantParameterError, match="num_summary"):
        SparseTransformerAttention(layout="fixed", stride=4, num_summary=5)


# ---------------------------------------------------------------------------------------------------------
# the kernel against the reference


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [64, 77])
@pytest.mark.parametrize("kind", ["none", "right", "left", "holes"])
def test_flash_path_equals_the_reference(pattern, causal, n, kind):
    variant = SparseTransformerAttention(layout=pattern, stride=8, num_summary=3)
    q, k, v = qkv(3, n)
    assert_same_output_and_gradients(variant, q, k, v, make_call(causal, padding(kind, 3, n)), atol=1e-5)


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [1, 300])
def test_gathered_parts_in_small_chunks_equal_the_reference(pattern, causal, chunk, monkeypatch):
    """The strided band and the fixed summaries run chunk by chunk (zoo.ops.gathered): one query block per
    chunk, or a few."""
    monkeypatch.setattr("zoo.ops.limits.GATHER_CHUNK_ELEMENTS", chunk)
    variant = SparseTransformerAttention(layout=pattern, stride=8, num_summary=3)
    q, k, v = qkv(3, 77)
    assert_same_output_and_gradients(variant, q, k, v, make_call(causal, padding("holes", 3, 77)), atol=1e-5)


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
@pytest.mark.parametrize("causal", [False, True])
def test_materialized_path_equals_the_reference(pattern, causal):
    """float64 takes the path that CUDA and dropout use (per-group scores, one shared softmax)."""
    variant = SparseTransformerAttention(layout=pattern, stride=16, num_summary=4)
    q, k, v = qkv(3, 150, dtype=torch.float64)
    # the reference computes in fp32
    assert_same_output_and_gradients(variant, q, k, v, make_call(causal, padding("holes", 3, 150)), atol=1e-5)


def test_dropout_drops_probabilities_and_keeps_the_normalizer():
    variant = SparseTransformerAttention(stride=8)
    q, k, v = (x.detach() for x in qkv(1, 64))
    torch.manual_seed(0)
    dropped = run_variant(variant, q, k, torch.ones_like(v), make_call(dropout=0.5, training=True))
    # with v = 1 every output is (sum of kept probabilities) / (1 - p): it averages to 1 over queries
    assert not torch.allclose(dropped, torch.ones_like(dropped)) and abs(dropped.mean().item() - 1) < 0.1


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 5, 16])
def test_inputs_up_to_the_stride_are_full_attention(pattern, causal, n):
    variant = SparseTransformerAttention(layout=pattern, stride=16, num_summary=4)
    q, k, v = qkv(2, n)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n // 2 + 1 :] = False
    call = make_call(causal, mask)
    out = run_variant(variant, q, k, v, call)
    full = softmax_attention(q, k, v, allowed_mask(call, None, 2, HEADS, n, n), call.scaling)
    torch.testing.assert_close(out, full.masked_fill(~mask[:, None, :, None], 0.0), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
def test_kv_cache_steps_equal_the_last_rows_of_the_full_forward(pattern):
    variant = SparseTransformerAttention(layout=pattern, stride=8, num_summary=2)
    q, k, v = (x.detach() for x in qkv(2, 70))
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[1, :9] = False  # left padding, as in generation
    full = run_variant(variant, q, k, v, make_call(True, mask))
    for new in (1, 3, 19):  # more new tokens than the stride too (several query chunks and blocks)
        step = run_variant(variant, q[:, :, -new:], k, v, make_call(True, mask))
        torch.testing.assert_close(step, full[:, :, -new:], atol=1e-5, rtol=1e-4)
    short = run_variant(variant, q[:, :, 5:6], k[:, :, :6], v[:, :, :6], make_call(True, mask[:, :6]))
    torch.testing.assert_close(short, run_variant(variant, q[:, :, :6], k[:, :, :6], v[:, :, :6],
                                                  make_call(True, mask[:, :6]))[:, :, -1:], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# cost


@pytest.mark.parametrize("layout", ["strided", "fixed"])
def test_no_n_by_n_intermediate_at_4096(layout):
    """Both layouts, both modes, forward and backward (the contract suite checks the default layout only)."""
    assert_memory_below_quadratic(SparseTransformerAttention(layout=layout))  # default stride 128 = 2·√n


def test_flops_grow_as_n_to_the_1_5_at_stride_root_n():
    def cost(n):
        return SparseTransformerAttention(stride=int(n**0.5)).flops(n, 12, 64)

    assert cost(16384) / cost(4096) == pytest.approx(8, rel=0.05)  # (4x)^1.5
    assert SparseTransformerAttention().flops(16384, 12, 64) < 4.0 * 16384**2 * 12 * 64 / 20


# ---------------------------------------------------------------------------------------------------------
# inside a model


def test_fixed_pattern_in_llama_with_padding_backward_and_reload():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, attention_dropout=0.0, pad_token_id=0,
    )
    zoo.configure(config, "sparse_transformer", layout="fixed", stride=16, num_summary=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 64, (2, 90))
    mask = torch.ones(2, 90, dtype=torch.long)
    mask[1, :20] = 0
    logits = model(input_ids=ids, attention_mask=mask).logits
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    reloaded = assert_reloads_identically(model, {"input_ids": ids, "attention_mask": mask})
    assert reloaded.config.attention_zoo["params"] == {"layout": "fixed", "stride": 16, "num_summary": 4}
    torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).logits, logits)


def test_configs_saved_with_the_old_parameter_name_pattern_load_with_that_layout(tmp_path, caplog):
    """Until 0.1.0 the layout parameter was called ``pattern`` (shadowed by the pattern() method)."""
    config = testing.tiny_model_config("bert", "sparse_transformer", layout="fixed", stride=8, num_summary=2)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["attention_zoo"]["params"] = {"pattern": "fixed", "stride": 8, "num_summary": 2}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with caplog.at_level(logging.WARNING, logger="zoo.variant"):
        old = transformers.AutoModel.from_pretrained(tmp_path).eval()
    assert zoo.variant_for(old.config).layout == "fixed"
    renamed = [r.getMessage() for r in caplog.records if r.name == "zoo.variant"]
    assert len(renamed) == 1 and "'pattern' is now called 'layout'" in renamed[0], renamed
    ids, mask = testing.model_inputs()
    torch.testing.assert_close(old(input_ids=ids, attention_mask=mask)[0], model(input_ids=ids, attention_mask=mask)[0])
    assert SparseTransformerAttention(pattern="fixed").config == SparseTransformerAttention(layout="fixed").config
    with pytest.raises(VariantParameterError, match="got both 'pattern' and 'layout'"):
        SparseTransformerAttention(pattern="fixed", layout="strided")
