"""The budgeted KV cache (zoo/cache.py BudgetedLayer, zoo/ops/kept.py, variants/budget.py) on tiny Llama (GQA)
models: exact while nothing is evicted, bounded and rectangular after, sinks / recent / padding rules per row and KV
head, chunked prefill, left-padded batches, beam search, hybrid per-layer budgets, the positions refusal."""

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.cache_utils import DynamicLayer

import zoo
from zoo.cache import POLICIES, BudgetedLayer, PositionsExhaustedError, cache_nbytes
from zoo.ops import softmax_attention
from zoo.ops.kept import kept_attention
from zoo.variant import VariantParameterError

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, attention_dropout=0.0, pad_token_id=0, eos_token_id=None)  # never stops early


def model(variant: str = "budget", max_positions: int = 256, **params):
    config = transformers.LlamaConfig(**SMALL, max_position_embeddings=max_positions)
    torch.manual_seed(0)
    built = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        built.get_output_embeddings().weight.mul_(8)  # no greedy ties in an untrained model
    return zoo.configure(built, variant, **params) if variant else built


def prompts(length=40, batch=2, left_pad=0, seed=1):
    ids = torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :left_pad] = 0
    return ids, mask


def greedy(m, ids, mask, new=8, **kwargs):
    with torch.no_grad():
        return m.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)


def cache_after(m, ids, mask, new=8, **kwargs):
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences, out.past_key_values


@pytest.mark.parametrize("policy", POLICIES)
def test_nothing_evicted_equals_sdpa_logits_and_greedy_tokens(policy):
    ids, mask = prompts(left_pad=5)
    sdpa, budget = model("sdpa"), model(tokens=64, sinks=2, recent=4, policy=policy)
    with torch.no_grad():
        torch.testing.assert_close(budget(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits,
                                   atol=0, rtol=0)
    assert torch.equal(greedy(budget, ids, mask), greedy(sdpa, ids, mask))
    assert torch.equal(greedy(budget, ids, mask), greedy(budget, ids, mask, use_cache=False))


@pytest.mark.parametrize("policy", POLICIES)
def test_evicts_to_the_budget_keeps_sinks_recent_and_no_padding(policy):
    ids, mask = prompts(length=60, left_pad=7)
    m = model(tokens=24, sinks=3, recent=6, policy=policy, slack=0)  # evicts after every call
    _, cache = cache_after(m, ids, mask, new=5)
    seen = 64  # the last generated token is never fed back
    for layer in cache.layers:
        assert isinstance(layer, BudgetedLayer) and layer.get_seq_length() == seen
        assert layer.keys.shape == (2, 2, 24, 8) and layer.pos.shape == (2, 2, 24)
        assert layer.real.all(), "padding keys are dropped first (each row has more real tokens than the budget)"
        for row, start in enumerate((7, 0)):
            for head in range(2):
                pos = layer.pos[row, head].tolist()
                assert pos == sorted(pos) and len(set(pos)) == 24
                assert set(range(start, start + 3)) <= set(pos), "the row's first real tokens are sinks"
                assert set(range(seen - 6, seen)) <= set(pos), "the recent keys are kept"
                assert min(pos) >= start


def test_kept_keys_differ_per_kv_head_for_a_scoring_policy():
    ids, mask = prompts(length=80)
    _, cache = cache_after(model(tokens=20, sinks=2, recent=4, policy="knorm"), ids, mask, new=3)
    assert any(not torch.equal(layer.pos[:, 0], layer.pos[:, 1]) for layer in cache.layers)


def test_bytes_flat_in_the_context():
    m = model(tokens=24, sinks=2, recent=4, policy="tova")
    sizes = {cache_nbytes(cache_after(m, *prompts(length))[1]) for length in (48, 96, 160)}
    assert len(sizes) == 1
    full = cache_nbytes(cache_after(model("sdpa"), *prompts(160))[1])
    assert sizes.pop() < full / 4


def test_kept_attention_matches_a_dense_reference_per_kv_head():
    gen = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, kept, queries, dim = 2, 2, 3, 10, 4, 8
    keys, values = (torch.randn(batch, kv_heads, kept, dim, generator=gen) for _ in range(2))
    q = torch.randn(batch, kv_heads * groups, queries, dim, generator=gen)
    pos = torch.stack([torch.randperm(30, generator=gen)[:kept].sort().values for _ in range(batch * kv_heads)])
    pos = pos.reshape(batch, kv_heads, kept)
    real = torch.rand(batch, kv_heads, kept, generator=gen) > 0.2
    query_pos = torch.tensor([12, 20, 25, 29])
    out, mass = kept_attention(q, keys, values, pos, real, query_pos, 0.3, want_mass=True)
    for head in range(kv_heads * groups):
        kv = head // groups
        allowed = real[:, kv, None, :] & (pos[:, kv, None, :] <= query_pos[None, :, None])
        ref = softmax_attention(q[:, head], keys[:, kv], values[:, kv], allowed, 0.3)
        torch.testing.assert_close(out[:, head], ref, atol=1e-5, rtol=1e-4)
    scores = torch.matmul(q.reshape(batch, kv_heads, groups, queries, dim), keys[:, :, None].transpose(-1, -2)) * 0.3
    allowed = real[:, :, None, None, :] & (pos[:, :, None, None, :] <= query_pos[:, None])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    torch.testing.assert_close(mass, probs.sum(dim=(2, 3)), atol=1e-5, rtol=1e-4)  # H2O's column sums


class _NewScoreBuffers(TorchDispatchMode):
    """Ops that produce a new tensor (not one of their inputs' storages) of at least ``numel`` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        out = func(*args, **(kwargs or {}))
        self.ops += [str(func) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.numel() >= self.numel
                     and t.untyped_storage().data_ptr() not in inputs]
        return out


def test_kept_attention_allocates_one_score_buffer_when_decoding():
    """Decoding (no autograd) builds one (batch, kv heads, group, queries, keys) fp32 buffer per query chunk and
    works in it in place (it ran four out-of-place copies: in a chunked prefill, at every layer and chunk, and
    glibc kept the freed copies in its heap, in the process's peak RSS)."""
    gen = torch.Generator().manual_seed(0)
    q, keys, values = torch.randn(1, 4, 64, 16, generator=gen), *torch.randn(2, 1, 2, 256, 16, generator=gen)
    pos, real = torch.arange(256).expand(1, 2, 256), torch.ones(1, 2, 256, dtype=torch.bool)
    with torch.no_grad(), _NewScoreBuffers(4 * 64 * 256) as probe:
        out, _ = kept_attention(q, keys, values, pos, real, torch.arange(192, 256), 0.25)
    assert len(probe.ops) == 1, probe.ops
    leaves = [x.clone().requires_grad_() for x in (q, keys, values)]  # autograd: out of place, same values
    again, _ = kept_attention(*leaves, pos, real, torch.arange(192, 256), 0.25)
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    again.sum().backward()
    assert all(leaf.grad is not None and torch.isfinite(leaf.grad).all() for leaf in leaves)


@pytest.mark.parametrize("policy", ["tova", "h2o", "snapkv", "expected_attention", "knorm"])
def test_left_padded_row_decodes_as_it_does_alone(policy):
    """Sinks count from each row's first real token and padding is never kept: a row in a left-padded batch keeps
    the keys it keeps alone, so it decodes the same tokens."""
    ids, mask = prompts(length=50, left_pad=9)
    m = model(tokens=20, sinks=2, recent=4, policy=policy)
    batched = greedy(m, ids, mask)
    alone = greedy(m, ids[:1, 9:], mask[:1, 9:])
    assert torch.equal(batched[0, 9:], alone[0])
    assert torch.equal(batched[1], greedy(m, ids[1:], mask[1:])[0])


def test_chunked_prefill_holds_at_most_budget_plus_chunk_and_decodes():
    ids, mask = prompts(length=96, left_pad=4)
    m = model(tokens=24, sinks=2, recent=4, policy="h2o", slack=0)
    held = []
    original = BudgetedLayer.update

    def spy(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        held.append(self.keys.shape[-2])
        return result

    BudgetedLayer.update = spy
    try:
        out, cache = cache_after(m, ids, mask, new=6, prefill_chunk_size=16)
    finally:
        BudgetedLayer.update = original
    assert max(held) <= 24 + 16 and out.shape == (2, 102)
    assert all(layer.get_seq_length() == 101 and layer.keys.shape[-2] == 24 for layer in cache.layers)


def test_chunked_prefill_equals_one_prefill_while_nothing_is_evicted():
    ids, mask = prompts(length=40, left_pad=3)
    m = model(tokens=64, sinks=2, recent=4, policy="tova")
    assert torch.equal(greedy(m, ids, mask, prefill_chunk_size=8), greedy(m, ids, mask))


def test_beam_search_with_and_without_eviction():
    ids, mask = prompts(length=40, left_pad=3)
    full = greedy(model("sdpa"), ids, mask, num_beams=3)
    assert torch.equal(greedy(model(tokens=64, sinks=2, recent=4), ids, mask, num_beams=3), full)
    evicting = greedy(model(tokens=16, sinks=2, recent=4, policy="h2o"), ids, mask, num_beams=3, num_return_sequences=2)
    assert evicting.shape == (4, 48)


def test_hybrid_per_layer_budgets():
    budgeted = {"variant": "budget", "params": {"tokens": 16, "sinks": 2, "recent": 4, "slack": 0}}
    m = model("hybrid", layers=["sdpa", budgeted])
    ids, mask = prompts(length=40, left_pad=2)
    _, cache = cache_after(m, ids, mask, new=4)
    assert type(cache.layers[0]) is DynamicLayer and cache.layers[0].keys.shape[-2] == 43
    assert isinstance(cache.layers[1], BudgetedLayer) and cache.layers[1].keys.shape[-2] == 16


def test_per_layer_token_list():
    _, cache = cache_after(model(tokens=[16, 32], sinks=2, recent=4, slack=0), *prompts(length=60), new=2)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [16, 32]


def test_refuses_positions_past_max_position_embeddings():
    m = model(max_positions=48, tokens=16, sinks=2, recent=4)
    ids, mask = prompts(length=44)
    with pytest.raises(PositionsExhaustedError, match="max_position_embeddings=48"):
        greedy(m, ids, mask, new=8)
    assert greedy(m, ids, mask, new=4).shape == (2, 48)


def test_bad_parameters():
    config = transformers.LlamaConfig(**SMALL)
    with pytest.raises(VariantParameterError, match="sinks \\+ recent"):
        zoo.configure(config, "budget", tokens=10, sinks=4, recent=8)
    with pytest.raises(VariantParameterError, match="'inner'"):
        zoo.configure(transformers.LlamaConfig(**SMALL), "budget", inner="longformer")


def test_crop_rolls_back_recent_tokens_only():
    layer = BudgetedLayer(8, sinks=1, recent=3, policy="sinks_recent")
    keys = torch.randn(1, 1, 12, 4)
    layer.update(keys, keys, kwargs={})
    layer.observe(torch.randn(1, 1, 12, 4), None, 0.5, None)
    assert layer.pos[0, 0].tolist() == [0, 5, 6, 7, 8, 9, 10, 11]
    layer.crop(-2)
    assert layer.get_seq_length() == 10 and layer.pos[0, 0].tolist() == [0, 5, 6, 7, 8, 9]
    with pytest.raises(zoo.cache.CacheRollbackError):
        layer.crop(-4)


@pytest.mark.slow
def test_smollm2_budget_equals_sdpa_when_nothing_is_evicted_and_stays_bounded():
    pretrained = pytest.importorskip("zoo.data.pretrained")
    try:
        pretrained.gguf_folder()
    except pretrained.PretrainedModelMissing as exc:
        pytest.skip(str(exc))
    m, tokenizer = pretrained.smollm2()
    ids = tokenizer("The pass key is 48213. Remember it. " * 12 + "What is the pass key? The pass key is",
                    return_tensors="pt").input_ids
    with torch.no_grad():
        full = m(ids).logits
        zoo.configure(m, "budget", tokens=ids.shape[1] + 8, sinks=4, recent=16, policy="tova")
        torch.testing.assert_close(m(ids).logits, full, atol=0, rtol=0)
        zoo.configure(m, "budget", tokens=64, sinks=4, recent=16, policy="tova", slack=0)
        out = m.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert all(layer.keys.shape[-2] == 64 for layer in out.past_key_values.layers)
