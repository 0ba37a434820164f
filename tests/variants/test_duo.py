"""``duo`` (head-level layouts) and its parts: the streaming kernel against softmax restricted to sinks + recent over
several query blocks, left padding and layouts (all full, all streaming, mixed); the head-split cache (bytes: every key
of the full heads only, bounded otherwise; beams; save and reload); refusals before any work."""

from __future__ import annotations

import pytest
import torch
import transformers
from zoo.variants import duo as duo_module
from zoo.variants.duo import DuoAttention
from zoo.variants.sdpa import grouped_rows_sdpa

import zoo
from zoo import testing
from zoo.cache import HeadSplitLayer, cache_nbytes
from zoo.call import AttentionCall
from zoo.ops import streaming
from zoo.pattern import row_starts
from zoo.testing import run_variant
from zoo.variant import VariantParameterError, reference


def qkv(batch=2, heads=6, kv_heads=3, n=70, dim=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, dim, generator=gen, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, n, dim, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("full_heads", [[[]], [[1]], [[0, 2]], [[0, 1, 2]]])
@pytest.mark.parametrize("sinks, recent", [(3, 8), (0, 5), (4, 100)])
@pytest.mark.parametrize("left_pad", [0, 9])
def test_kernel_equals_softmax_restricted_to_the_layout(full_heads, sinks, recent, left_pad, monkeypatch):
    monkeypatch.setattr(streaming, "QUERY_BLOCK", 16)  # several query blocks at n = 70
    variant = DuoAttention(full_heads=full_heads, sinks=sinks, recent=recent)
    q, k, v = qkv()
    mask = torch.ones(2, q.shape[-2], dtype=torch.bool)
    mask[1, :left_pad] = False
    padding = mask if left_pad else None
    call = AttentionCall(causal=True, scaling=0.3, padding_mask=padding, row_start=row_starts(padding))
    out = run_variant(variant, q, k, v, call)
    torch.testing.assert_close(out, reference(variant, q, k, v, call), atol=2e-6, rtol=0)  # the reference is fp32


def test_streaming_heads_see_only_sinks_and_recent_keys():
    """Changing a key a streaming query cannot reach changes nothing; a sink or a recent key changes its output."""
    variant = DuoAttention(full_heads=[[]], sinks=2, recent=4)
    q, k, v = qkv(kv_heads=6)
    call = AttentionCall(causal=True, scaling=0.3)
    out = run_variant(variant, q, k, v, call)
    for position, reached in ((10, False), (1, True), (66, True)):
        changed = v.clone()
        changed[:, :, position] += 1.0
        moved = (run_variant(variant, q, k, changed, call)[:, :, -1] - out[:, :, -1]).abs().max()
        assert (moved > 1e-6) == reached, (position, moved)


def decoder(**params):
    config = testing.tiny_model_config("llama", "duo", **params)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def test_cache_keeps_every_key_of_the_full_heads_only():
    ids, mask = testing.decode_prompts(length=60)
    sizes = {}
    for name, heads in (("none", [[]]), ("one", [[0]]), ("all", [[0, 1]])):
        model = decoder(full_heads=heads, sinks=2, recent=8)
        with torch.no_grad():
            short = testing.greedy(model, ids[:, :30], mask[:, :30], return_dict_in_generate=True).past_key_values
            long = testing.greedy(model, ids, mask, return_dict_in_generate=True).past_key_values
        assert all(isinstance(layer, HeadSplitLayer) for layer in long.layers)
        sizes[name] = (cache_nbytes(short), cache_nbytes(long))
    assert sizes["none"][0] == sizes["none"][1]  # streaming only: bounded
    growth = {name: long - short for name, (short, long) in sizes.items()}
    assert growth["none"] == 0 < growth["one"] < growth["all"]
    layer = long.layers[0]
    keys = layer.full.keys
    assert keys.shape[1] == 2 and keys.shape[-2] == 60 + testing.DECODE_NEW_TOKENS - 1


def test_beam_search_with_the_cache_equals_without():
    model = decoder(full_heads=[[1]], sinks=2, recent=8)
    ids, mask = testing.decode_prompts()
    with torch.no_grad():
        cached = testing.greedy(model, ids, mask, num_beams=3)
        full = testing.greedy(model, ids, mask, num_beams=3, use_cache=False)
    assert torch.equal(cached, full)


def test_layout_saves_and_reloads(tmp_path):
    model = decoder(full_heads=[[1], []], sinks=2, recent=8)
    ids, mask = testing.decode_prompts()
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert zoo.variant_for(again.config).full_heads == [[1], []]
    with torch.no_grad():
        torch.testing.assert_close(again(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("params, named", [
    ({"full_heads": [[2]]}, "full_heads for layer 0"),  # the tiny Llama has 2 KV heads
    ({"full_heads": [[0], [1], [0]]}, "3 lists for a model of 2 layers"),
    ({"full_heads": [[0, 0]]}, "distinct KV head"),
    ({"full_heads": [0, 1]}, "list of lists"),
    ({"recent": 4000}, "max_position_embeddings"),
])
def test_layouts_that_do_not_fit_are_refused_at_configure(params, named):
    config = testing.tiny_model_config("llama", "sdpa")
    config.max_position_embeddings = 2048
    with pytest.raises(VariantParameterError, match=named):
        zoo.configure(transformers.AutoModelForCausalLM.from_config(config), "duo",
                      **{"full_heads": [[0]], **params})


def test_a_budget_on_the_full_heads_bounds_them_and_decodes_like_budget_alone():
    """``full_budget`` keeps what ``budget`` would of the full heads: with every head full it is ``budget`` itself
    (same tokens, same bytes); with one head full its cache grows by a quarter of the prompt on that head only."""
    ids, mask = testing.decode_prompts(length=60)
    options = {"policy": "snapkv", "sinks": 2, "recent": 8}
    with torch.no_grad():
        duo = decoder(full_heads=[[0, 1]], sinks=2, recent=8, full_budget={"tokens": 24, **options})
        budget = testing.causal_lm("budget", tokens=24, **options)
        got = testing.greedy(duo, ids, mask, return_dict_in_generate=True)
        want = testing.greedy(budget, ids, mask, return_dict_in_generate=True)
        assert torch.equal(got.sequences, want.sequences)
        assert cache_nbytes(got.past_key_values) == cache_nbytes(want.past_key_values)
        one = decoder(full_heads=[[0]], sinks=2, recent=8, full_budget={"budget": 0.25, **options})
        caches = [testing.greedy(one, ids[:, :n], mask[:, :n], return_dict_in_generate=True).past_key_values
                  for n in (40, 60)]
    layers = [cache.layers[0].full for cache in caches]
    assert [layer.tokens for layer in layers] == [10, 15]  # a quarter of each prompt
    assert all(layer.keys.shape[-2] <= layer.tokens + layer.slack for layer in layers)
    assert cache_nbytes(caches[0]) < cache_nbytes(caches[1])


@pytest.mark.parametrize("spec, named", [({"budget": 0}, "in \\(0, 1\\]"), ({}, "either 'budget'"),
                                         ({"budget": 0.5, "tokens": 9}, "either 'budget'"),
                                         ({"budget": 0.5, "window": 3}, "either 'budget'"),
                                         ({"budget": 0.5, "policy": "nope"}, "full_budget")])
def test_bad_full_budgets_are_refused(spec, named):
    with pytest.raises(VariantParameterError, match=named):
        DuoAttention(full_heads=[[0]], full_budget=spec)


def test_unpadded_decoding_reads_the_whole_buffer_without_a_mask_and_equals_the_full_forward(monkeypatch):
    model = decoder(full_heads=[[1], []], sinks=2, recent=8)
    ids, _ = testing.decode_prompts()
    mask = torch.ones_like(ids)
    calls = []
    monkeypatch.setattr(duo_module, "grouped_rows_sdpa", lambda *args: calls.append(1) or grouped_rows_sdpa(*args))
    with torch.no_grad():
        cached = testing.greedy(model, ids, mask)
        full = testing.greedy(model, ids, mask, use_cache=False)
    assert torch.equal(cached, full)
    assert len(calls) == 2 * (testing.DECODE_NEW_TOKENS - 1)  # every decoding step of both layers
