"""zoo/bench/kv_accuracy.py: the shared prefill of the passkey benchmark decodes exactly what each contestant's own
``generate`` decodes (tiny Llama, GQA), so the accuracy table may run one prefill for all of them."""

import json

import pytest
import torch
import transformers

from zoo.bench.kv_accuracy import shared_generate
from zoo.bench.kv_contestants import prepare
from zoo.bench.passkey import NEW_TOKENS
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
    kwargs = prepare(model, dict(job), ids.shape[1])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs)


def test_shared_prefill_decodes_what_each_contestant_decodes():
    ids = torch.randint(3, 64, (2, 200), generator=torch.Generator().manual_seed(1))
    jobs = [{"name": "full", "family": "full", "budget": 1.0}]
    jobs += [{"name": p, "family": "budget", "policy": p, "budget": b} for p in POLICIES for b in (0.5, 0.4)]
    model = tiny()
    shared = shared_generate(model, ids, jobs)
    for job, (sequences, cache) in zip(jobs, shared, strict=True):
        kwargs = prepare(model, dict(job), ids.shape[1])
        with torch.no_grad():
            own = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
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
    (sequences, _), = shared_generate(model, ids, [job])
    assert torch.equal(sequences, own_generate(model, ids, job))


def test_take_turns_alternates_rounds_and_records_a_failing_player():
    """The benchmarks' one decode timer: prefill each player once, then rounds in alternating order; a player that
    raises is recorded and leaves while the others go on."""
    from zoo.bench.timer import take_turns

    calls = []

    def player(name: str, fail_on_turn: int | None = None):
        turns = []

        def turn() -> list[float]:
            turns.append(1)
            if len(turns) == fail_on_turn:
                raise RuntimeError("out of memory")
            calls.append(name)
            return [0.001 * len(turns), 0.003 * len(turns)]

        return (lambda: calls.append(f"prefill {name}") or {"first_token_s": 1.0}), turn

    results = take_turns({"a": player("a"), "b": player("b", fail_on_turn=2), "c": player("c")}, rounds=3)
    assert calls == ["prefill a", "prefill b", "prefill c", "a", "b", "c", "c", "a", "a", "c"]
    assert results["a"]["round_ms"] == pytest.approx([2.0, 4.0, 6.0])
    assert results["a"]["gaps"] == pytest.approx([0.001, 0.003, 0.002, 0.006, 0.003, 0.009])
    assert results["a"]["first_token_s"] == 1.0 and results["a"]["status"] == "ok"
    assert results["b"]["status"] == "error" and results["b"]["error"] == "RuntimeError: out of memory"
    with pytest.raises(RuntimeError):
        take_turns({"b": player("b", fail_on_turn=1)}, rounds=1, catch=False)


def test_kv_report_renders_the_accuracy_rows_and_writes_the_plot(tmp_path):
    from zoo.bench.cli import kv_main

    rows = [{"name": "full cache (transformers)", "family": "full", "budget": 1.0, "context": 64,
             "per_prompt_bytes": 2**20, "found": [True, True], "depths": [0.1, 0.9]},
            {"name": "budget tova", "family": "budget", "policy": "tova", "budget": 0.5, "context": 64,
             "per_prompt_bytes": 2**19, "found": [True, False], "depths": [0.1, 0.9]}]
    (tmp_path / "accuracy.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert kv_main(["report", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "kv.md").read_text()
    assert "| 64 | 50% | 1/2 (tova) | – | – | tova 1 | – |" in text
    assert "| budget tova | 50% | 0.5 | 1/2 | 1/1 | 0/1 |" in text
    assert (tmp_path / "kv.png").stat().st_size > 0
