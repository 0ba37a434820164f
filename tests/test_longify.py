"""zoo.convert.longify: tiled position tables keep short-input outputs, respect RoBERTa's offset, round-trip."""

import pytest
import torch
import transformers

import zoo
from zoo.convert.longify import PositionLimitError, check_max_length, longify, position_capacity
from zoo.training.config import resolve_pretrained

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 99}


def tiny(model_class, config_class, **overrides):
    torch.manual_seed(0)
    return model_class(config_class(**{**TINY, **overrides})).eval()


def hidden(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).last_hidden_state


def test_bert_outputs_below_the_old_limit_are_unchanged_and_the_table_is_tiled():
    model = tiny(transformers.BertModel, transformers.BertConfig, max_position_embeddings=512)
    old = model.embeddings.position_embeddings.weight.detach().clone()
    ids = torch.randint(5, 99, (2, 300))
    before = hidden(model, ids)
    longify(model, 1200)
    table = model.embeddings.position_embeddings.weight
    assert table.shape == (1200, 32) and model.config.max_position_embeddings == 1200
    assert torch.equal(table[:512], old) and torch.equal(table[512:1024], old) and torch.equal(table[1024:], old[:176])
    assert torch.equal(hidden(model, ids), before)
    assert hidden(model, torch.randint(5, 99, (1, 1200))).shape == (1, 1200, 32)
    assert position_capacity(model) == 1200


def test_roberta_reserved_rows_are_kept_and_positions_still_start_after_padding():
    model = tiny(transformers.RobertaModel, transformers.RobertaConfig, max_position_embeddings=514, pad_token_id=1)
    old = model.embeddings.position_embeddings.weight.detach().clone()
    assert position_capacity(model) == 512
    ids = torch.randint(5, 99, (2, 500))
    before = hidden(model, ids)
    longify(model, 1024)
    table = model.embeddings.position_embeddings.weight
    assert table.shape[0] == 1026 and model.config.max_position_embeddings == 1026
    assert torch.equal(table[:2], old[:2])  # rows before position 0 (padding_idx + 1 of them)
    assert torch.equal(table[2:514], old[2:]) and torch.equal(table[514:1026], old[2:])
    assert torch.equal(hidden(model, ids), before)
    assert hidden(model, torch.randint(5, 99, (1, 1024))).shape == (1, 1024, 32)


def test_longified_model_round_trips_through_save_pretrained(tmp_path):
    model = tiny(transformers.BertModel, transformers.BertConfig, max_position_embeddings=64)
    longify(model, 200)
    ids = torch.randint(5, 99, (1, 200))
    model.save_pretrained(tmp_path)
    reloaded = transformers.BertModel.from_pretrained(tmp_path).eval()
    assert torch.equal(hidden(reloaded, ids), hidden(model, ids))


def test_minilm_keeps_its_outputs_on_short_inputs():
    path, _ = resolve_pretrained("minilm")
    config = transformers.AutoConfig.from_pretrained(path)
    zoo.configure(config, "sdpa")
    model = transformers.AutoModel.from_pretrained(path, config=config).eval()
    ids = torch.randint(1000, 20000, (1, 128))
    before = hidden(model, ids)
    with pytest.raises(PositionLimitError, match="max_length=2048 exceeds the 512 positions.*longify: true"):
        check_max_length(model, 2048)
    longify(model, 2048)
    check_max_length(model, 2048)
    assert torch.equal(hidden(model, ids), before)


def test_models_without_a_learned_table_are_refused():
    config = transformers.LlamaConfig(**TINY, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaModel(config)
    with pytest.raises(PositionLimitError, match="no learned absolute position table"):
        longify(model, 512)


def test_longify_is_a_no_op_when_the_model_is_long_enough():
    model = tiny(transformers.BertModel, transformers.BertConfig, max_position_embeddings=512)
    table = model.embeddings.position_embeddings
    assert longify(model, 256) is model and model.embeddings.position_embeddings is table
