"""zoo/bench/kv.py: the shared prefill of the passkey benchmark decodes exactly what each contestant's own
``generate`` decodes (tiny Llama, GQA), so the accuracy table may run one prefill for all of them."""

import pytest
import torch
import transformers

from zoo.bench import kv
from zoo.cache import POLICIES, cache_nbytes

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, attention_dropout=0.0, pad_token_id=0, eos_token_id=None,
             max_position_embeddings=512)


def tiny():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)  # no greedy ties in an untrained model
    return model


def own_generate(model, ids, job):
    kwargs = kv.prepare(model, dict(job), ids.shape[1])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=kv.NEW_TOKENS,
                              min_new_tokens=kv.NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs)


def test_shared_prefill_decodes_what_each_contestant_decodes():
    ids = torch.randint(3, 64, (2, 200), generator=torch.Generator().manual_seed(1))
    jobs = [{"name": "full", "family": "full", "budget": 1.0}]
    jobs += [{"name": p, "family": "budget", "policy": p, "budget": b} for p in POLICIES for b in (0.5, 0.4)]
    model = tiny()
    shared = kv.shared_generate(model, ids, jobs)
    for job, (sequences, cache) in zip(jobs, shared, strict=True):
        kwargs = kv.prepare(model, dict(job), ids.shape[1])
        with torch.no_grad():
            own = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=kv.NEW_TOKENS,
                                 min_new_tokens=kv.NEW_TOKENS, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True, **kwargs)
        assert torch.equal(sequences, own.sequences), job
        assert cache_nbytes(cache) == cache_nbytes(own.past_key_values), job  # the same state kept
        if job["family"] == "budget":  # evicted to the budget, as its own run
            assert {layer.keys.shape[-2] for layer in cache.layers} == {int(job["budget"] * 200)}


def test_shared_prefill_quantized_cache_matches_its_own_run():
    pytest.importorskip("optimum.quanto")
    ids = torch.randint(3, 64, (1, 160), generator=torch.Generator().manual_seed(2))
    job = {"name": "q4", "family": "quantized", "nbits": 4, "budget": 4 / 32}
    model = tiny()
    (sequences, _), = kv.shared_generate(model, ids, [job])
    assert torch.equal(sequences, own_generate(model, ids, job))
