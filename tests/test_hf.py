"""The Hugging Face plug: model families, padding, persistence, clear errors, and the plugin path."""

import json
import subprocess
import sys

import pytest
import torch
import transformers

import zoo

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
FAMILIES = {
    "bert": lambda: transformers.BertConfig(**SMALL),
    "roberta": lambda: transformers.RobertaConfig(**SMALL, pad_token_id=1),
    "xlm-roberta": lambda: transformers.XLMRobertaConfig(**SMALL, pad_token_id=1),
    "electra": lambda: transformers.ElectraConfig(**SMALL, embedding_size=32),
    "albert": lambda: transformers.AlbertConfig(**SMALL, embedding_size=16),
    "distilbert": lambda: transformers.DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64),
    "modernbert": lambda: transformers.ModernBertConfig(
        **SMALL, global_attn_every_n_layers=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
        sep_token_id=2,
    ),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=1,
                                            eos_token_id=2),
    "llama": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, num_key_value_heads=2),
    "mistral": lambda: transformers.MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=None),
}


def _padded_batch(n=24, real=17, left=False):
    ids = torch.randint(3, 64, (2, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, n, dtype=torch.long)
    if left:
        mask[1, : n - real] = 0
    else:
        mask[1, real:] = 0
    return ids, mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_matches_its_native_sdpa_with_padding(family):
    """The `sdpa` variant through our plug equals transformers' own sdpa on real tokens, for every family."""
    torch.manual_seed(0)
    native = transformers.AutoModel.from_config(FAMILIES[family](), attn_implementation="sdpa").eval()
    ours = transformers.AutoModel.from_config(zoo.configure(FAMILIES[family](), "sdpa")).eval()
    ours.load_state_dict(native.state_dict())
    assert ours.config._attn_implementation == zoo.IMPLEMENTATION
    decoder = family in {"gpt2", "llama", "qwen2", "mistral"}
    ids, mask = _padded_batch(left=decoder)
    want = native(input_ids=ids, attention_mask=mask).last_hidden_state
    got = ours(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_padding_is_never_attended(family):
    """The padding trap (a custom implementation without a mask function gets no mask): a padded row must give
    the same outputs as the same row alone, unpadded."""
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(zoo.configure(FAMILIES[family](), "dense")).eval()
    ids, mask = _padded_batch()
    batched = model(input_ids=ids, attention_mask=mask).last_hidden_state[1, :17]
    alone = model(input_ids=ids[1:, :17]).last_hidden_state[0]
    torch.testing.assert_close(batched, alone, atol=2e-5, rtol=1e-4)


def test_configure_persists_variant_params_and_source(tmp_path):
    config = zoo.configure(transformers.BertConfig(**SMALL), "chunked_exact", chunk_size=8)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attn_implementation"] == zoo.IMPLEMENTATION
    assert saved["attention_zoo"]["variant"] == "chunked_exact"
    assert saved["attention_zoo"]["params"] == {"chunk_size": 8}
    assert saved["attention_zoo"]["package"] == "zoo-chunked-plugin" and saved["attention_zoo"]["version"] == "0.0.1"
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert zoo.variant_for(reloaded.config).chunk_size == 8
    reloaded.save_pretrained(tmp_path / "again")  # a reloaded model saves the variant again
    assert json.loads((tmp_path / "again" / "config.json").read_text())["attention_zoo"]["params"] == {"chunk_size": 8}


def test_configure_an_instantiated_model_switches_it():
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(transformers.BertConfig(**SMALL)).eval()
    ids, mask = _padded_batch()
    before = model(input_ids=ids, attention_mask=mask).last_hidden_state
    zoo.configure(model, "dense")
    assert model.config._attn_implementation == zoo.IMPLEMENTATION
    after = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(after[mask.bool()], before[mask.bool()], atol=2e-5, rtol=1e-4)


def _save_sdpa_bert(path):
    transformers.AutoModel.from_config(zoo.configure(transformers.BertConfig(**SMALL), "sdpa")).save_pretrained(path)


@pytest.mark.parametrize(
    "config",
    [transformers.LongformerConfig, transformers.BigBirdConfig, transformers.DebertaConfig, transformers.MPNetConfig,
     transformers.LEDConfig],
)
def test_models_off_the_interface_are_refused(config, tmp_path):
    with pytest.raises(zoo.UnsupportedModelError, match="never calls transformers' attention interface"):
        zoo.configure(config(), "sdpa")


def test_unsupported_model_is_refused_at_load_time_too(tmp_path):
    cfg = transformers.MPNetConfig(**SMALL)
    transformers.AutoModel.from_config(cfg).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.update(attn_implementation=zoo.IMPLEMENTATION, attention_zoo={"variant": "sdpa", "params": {}})
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(zoo.UnsupportedModelError):
        transformers.AutoModel.from_pretrained(tmp_path)


def test_loading_a_variant_that_is_not_installed_names_the_package(tmp_path):
    _save_sdpa_bert(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["attention_zoo"].update(variant="ring_attention", package="zoo-ring-plugin", version="2.0")
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(zoo.UnknownVariantError, match=r"'ring_attention'.*pip install zoo-ring-plugin"):
        transformers.AutoModel.from_pretrained(tmp_path)


def test_without_import_zoo_loading_fails_loudly_instead_of_running_dense(tmp_path):
    _save_sdpa_bert(tmp_path)
    code = f"import transformers; transformers.AutoModel.from_pretrained({str(tmp_path)!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and "pip install attention-zoo" in result.stderr


def test_causal_only_checks_and_output_attentions_error():
    @zoo.register_variant
    class BidirectionalOnly(zoo.Variant):
        name = "bidirectional_only"
        supports_causal = False

        def attend(self, q, k, v, call):
            return v

    try:
        with pytest.raises(ValueError, match="does not support causal attention"):
            zoo.configure(transformers.LlamaConfig(**SMALL), "bidirectional_only")
    finally:
        zoo.unregister_variant("bidirectional_only")
    model = transformers.AutoModel.from_config(zoo.configure(transformers.BertConfig(**SMALL), "sdpa"))
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long), output_attentions=True)


def test_third_party_plugin_end_to_end(tmp_path):
    """Discovered from its own package, configured into BERT, trained one step, saved, reloaded."""
    assert "chunked_exact" in zoo.list_variants()
    torch.manual_seed(0)
    config = zoo.configure(transformers.BertConfig(**SMALL, num_labels=3), "chunked_exact", chunk_size=5)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    ids, mask = _padded_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 2])).loss
    loss.backward()
    optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    model.eval()
    logits = model(input_ids=ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).logits, logits)


# ------------------------------------------------------------------------------------------------------
# cross-attention and global tokens under padding (issue 21 item 10)


def _bert_decoder(name=None, **params):
    config = transformers.BertConfig(**{**SMALL, "num_hidden_layers": 1}, is_decoder=True, add_cross_attention=True,
                                     attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    if name is None:
        config._attn_implementation = "sdpa"
    else:
        zoo.configure(config, name, **params)
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


def _cross_inputs():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (1, 7), generator=generator)
    encoder = torch.randn(1, 7, 32, generator=generator)
    encoder_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    return dict(input_ids=ids, encoder_hidden_states=encoder, encoder_attention_mask=encoder_mask)


@pytest.mark.parametrize("name", ["sdpa", "dense"])
def test_cross_attention_over_a_padded_encoder_equals_transformers_sdpa(name):
    """7 decoder and 7 encoder tokens, the encoder padded: the key padding must not zero decoder rows."""
    reference, model = _bert_decoder(), _bert_decoder(name)
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        want = reference(**_cross_inputs()).last_hidden_state
        got = model(**_cross_inputs()).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name, params", [("longformer", {"window": 4}), ("xformers", {"window": 4}),
                                          ("bigbird", {"block_size": 2}), ("linear", {})])
def test_cross_attention_is_refused_by_variants_whose_pattern_is_over_one_sequence(name, params):
    model = _bert_decoder(name, **params)
    with pytest.raises(ValueError, match="does not support cross-attention"), torch.no_grad():
        model(**_cross_inputs())


def _padded_three_ways(ids, pad):
    """The row alone, left-padded and right-padded by ``pad`` tokens: (ids, mask, slice of the real tokens)."""
    n = ids.shape[-1]
    ones, zeros = torch.ones(1, n, dtype=torch.long), torch.zeros(1, pad, dtype=torch.long)
    filler = torch.full((1, pad), 5)
    return [
        (ids, ones, slice(0, n)),
        (torch.cat([filler, ids], -1), torch.cat([zeros, ones], -1), slice(pad, pad + n)),
        (torch.cat([ids, filler], -1), torch.cat([ones, zeros], -1), slice(0, n)),
    ]


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_global_tokens_are_the_first_real_tokens_of_each_row(family):
    """One row alone, left-padded and right-padded: the same outputs at its real tokens (global_tokens count from
    the row's first real token, not from position 0 of the padded tensor). Position ids count real tokens, as in
    transformers' own left-padding test."""
    config = FAMILIES[family]()
    zoo.configure(config, "longformer", window=4, global_tokens=[0, 1])
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    outs = []
    with torch.no_grad():
        for tokens, mask, real in _padded_three_ways(ids, 4):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            outs.append(model(input_ids=tokens, attention_mask=mask, position_ids=positions).last_hidden_state[:, real])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(outs[2], outs[0], atol=1e-5, rtol=1e-4)
