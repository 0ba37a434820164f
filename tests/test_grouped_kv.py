"""Grouped-query keys reach the kernels that take them unexpanded (``grouped_kv``): sdpa's decoding step folds a
group's query heads into rows instead of copying the cache once per query head; every other kernel still gets one
key/value head per query head, also inside a hybrid."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from zoo.variants.sdpa import SDPAAttention

import zoo
from zoo.call import AttentionCall
from zoo.ops import expand_kv
from zoo.plug.dispatch import run_variant
from zoo.registry import get_variant_class


@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_a_grouped_decoding_step_equals_the_expanded_one(new, padded):
    torch.manual_seed(0)
    q = torch.randn(2, 6, new, 16)
    k, v = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    real = torch.ones(2, 40, dtype=torch.bool)
    if padded:
        real[1, :7] = False  # left padding in the second row
    call = AttentionCall(causal=True, scaling=0.25, padding_mask=real if padded else None, decoding=True)
    grouped = SDPAAttention().attend(q, k, v, call)
    expanded = SDPAAttention().attend(q, *expand_kv(k, v, 6), call)
    assert torch.allclose(grouped, expanded, atol=1e-6)
    # the reference: softmax over the allowed keys of each query, its group's key/value head
    for head in range(6):
        scores = q[:, head] @ k[:, head // 3].transpose(-1, -2) * 0.25
        allowed = real[:, None, :] & (torch.arange(40) <= torch.arange(40 - new, 40)[:, None])
        want = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[:, head // 3]
        assert torch.allclose(grouped[:, head], want, atol=1e-5)


def _spy(monkeypatch, name):
    seen = []
    cls = get_variant_class(name)
    original = cls.attend

    def attend(self, q, k, v, call):
        seen.append((q.shape[1], k.shape[1]))
        return original(self, q, k, v, call)

    monkeypatch.setattr(cls, "attend", attend)
    return seen


def test_dispatch_expands_only_for_kernels_that_need_it(monkeypatch):
    sdpa_heads, window_heads = _spy(monkeypatch, "sdpa"), _spy(monkeypatch, "longformer")
    q, k, v = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    call = AttentionCall(causal=True, scaling=8**-0.5)
    run_variant(get_variant_class("sdpa")(), q, k, v, call)
    run_variant(get_variant_class("longformer")(window=4), q, k, v, call)
    hybrid = get_variant_class("hybrid")(layers=["sdpa", {"variant": "longformer", "params": {"window": 4}}])
    for layer in (0, 1):
        run_variant(hybrid, q, k, v, AttentionCall(causal=True, scaling=8**-0.5, layer_idx=layer))
    assert sdpa_heads == [(4, 2), (4, 2)]
    assert window_heads == [(4, 4), (4, 4)]


@pytest.mark.parametrize("variant, params", [
    ("hybrid", {"layers": [{"variant": "gated_deltanet", "params": {"short_conv": 4}}, "sdpa"]}),
    ("moba", {"block_size": 4, "top_k": 1}),
], ids=["hybrid", "moba"])
def test_grouped_key_decoding_equals_the_model_without_a_cache(variant, params):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    zoo.configure(model, variant, **params)
    prompt = torch.randint(0, 64, (2, 12))
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        cached = model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        plain = model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                               use_cache=False)
    assert torch.equal(cached, plain)


def test_moba_gathers_a_grouped_cache_as_an_expanded_one():
    from zoo.ops import chosen_blocks as selection

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    key_pos = torch.randint(0, 20, (2, 6, 1, 5))
    ok = torch.rand(2, 6, 1, 5) > 0.3
    ok[..., 0] = True
    call = AttentionCall(causal=True, scaling=8**-0.5, decoding=True)
    grouped = selection.attention_at_positions(q, k, v, key_pos, ok, call)
    expanded = selection.attention_at_positions(q, *expand_kv(k, v, 6), key_pos, ok, call)
    assert torch.allclose(grouped, expanded, atol=1e-6)
