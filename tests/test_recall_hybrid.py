"""The ``hybrid`` variant: a variant per layer, saved in config.json, each layer decoding with its own cache kind."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicLayer

import zoo
from zoo.cache import RecurrentLayer, WindowedLayer
from zoo.testing import assert_reloads_identically
from zoo.variant import AttentionCall

LAYERS = [
    {"variant": "linear", "params": {"chunk_size": 8}},
    {"variant": "longformer", "params": {"window": 8, "global_tokens": [0]}},
    "sdpa",
]


def _model(layers=LAYERS, num_hidden_layers=3):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=num_hidden_layers,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                      pad_token_id=0)  # fmt: skip
    zoo.configure(config, "hybrid", layers=layers)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)  # untrained: separate the greedy choices
    return model


def _prompt():
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    return ids, mask


def test_each_layer_runs_its_own_variant():
    """A model's first layer gives what the model of its variant alone gives (same weights); the mix as a whole
    differs from every single variant."""
    hybrid = _model()
    ids, mask = _prompt()
    with torch.no_grad():
        mixed = hybrid(ids, attention_mask=mask, output_hidden_states=True)
    for index, entry in enumerate(LAYERS):
        single = _model([entry])
        single.load_state_dict(hybrid.state_dict())
        with torch.no_grad():
            alone = single(ids, attention_mask=mask, output_hidden_states=True)
        real = mask.bool()
        first_layer_equal = torch.allclose(alone.hidden_states[1][real], mixed.hidden_states[1][real], atol=1e-5)
        assert first_layer_equal == (index == 0)
        assert not torch.allclose(alone.logits[real], mixed.logits[real], atol=1e-4)


def test_saved_in_config_json_and_reloads(tmp_path):
    model = _model()
    ids, mask = _prompt()
    reloaded = assert_reloads_identically(model, {"input_ids": ids, "attention_mask": mask}, path=tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["attention_zoo"]
    assert saved["variant"] == "hybrid"
    assert [entry["variant"] for entry in saved["params"]["layers"]] == ["linear", "longformer", "sdpa"]
    assert zoo.variant_for(reloaded.config).part(1).window == 8


def test_generate_with_per_layer_caches_equals_uncached_decoding():
    model = _model()
    ids, mask = _prompt()
    options = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **options)
    kinds = [type(layer) for layer in out.past_key_values.layers]
    assert kinds == [RecurrentLayer, WindowedLayer, DynamicLayer]
    torch.testing.assert_close(out.sequences, model.generate(ids, attention_mask=mask, use_cache=False, **options),
                               rtol=0, atol=0)  # fmt: skip


def test_layers_cycle_and_state_is_smaller_than_sdpa():
    """4 layers from a 2-entry list: window, linear, window, linear; the cache holds far less than sdpa's."""
    layers = [{"variant": "longformer", "params": {"window": 8}}, {"variant": "linear", "params": {"chunk_size": 8}}]
    model = _model(layers, num_hidden_layers=4)
    ids = torch.randint(3, 64, (1, 200), generator=torch.Generator().manual_seed(2))
    options = {"max_new_tokens": 1, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
    cache = model.generate(ids, **options).past_key_values
    assert [type(layer) for layer in cache.layers] == [WindowedLayer, RecurrentLayer] * 2
    full = _model(["sdpa"], num_hidden_layers=4).generate(ids, **options).past_key_values
    assert zoo.cache_nbytes(cache) * 8 <= zoo.cache_nbytes(full)


@pytest.mark.parametrize(
    "layers, message",
    [([], "empty"), ([{"name": "sdpa"}], "must be a variant name"), (["hybrid"], "cannot itself"),
     (["no_such_variant"], "no_such_variant"), ([{"variant": "longformer", "params": {"window": 0}}], "window")],
)  # fmt: skip
def test_bad_layer_entries_are_named(layers, message):
    with pytest.raises(ValueError, match=message):
        zoo.get_variant_class("hybrid")(layers=layers)


def test_a_layer_without_causal_support_is_refused_in_a_decoder():
    with pytest.raises(ValueError, match="'hybrid' does not support causal attention"):  # at configure time
        _model([{"variant": "linformer", "params": {"k": 8}}], num_hidden_layers=1)
    hybrid = zoo.get_variant_class("hybrid")(layers=[{"variant": "linformer", "params": {"k": 8}}])
    call = AttentionCall(causal=True, scaling=1.0)
    with pytest.raises(ValueError, match="linformer.*layer 0.*causal"):  # and per layer, for direct callers
        hybrid.attend(*torch.randn(3, 1, 2, 16, 8), call)


def test_listed_by_zoo_list():
    assert "hybrid" in zoo.list_variants()


def test_a_hybrid_with_a_reformer_layer_has_ddp_look_for_unused_parameters():
    from zoo.training import finetune as train
    from zoo.training.config import FinetuneConfig

    def cfg(layers):
        return FinetuneConfig(task="listops", output_dir="unused", model_config={"model_type": "bert"},
                                    variant="hybrid", variant_params={"layers": layers})

    assert train.find_unused_parameters(cfg(["sdpa", "reformer"]))  # reformer's key projection gets no gradient
    assert not train.find_unused_parameters(cfg(["sdpa", "linear"]))
