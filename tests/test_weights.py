"""Variants with learned per-layer weights: created with the model, trained, saved, loaded, initialised
deterministically when a checkpoint lacks them."""

import logging

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import zoo
from zoo.ops import softmax_attention
from zoo.plug.weights import WEIGHTS_NAME, attention_modules, seed_for
from zoo.testing import contract, make_call, make_weights

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


class ValueMixer(nn.Module):
    """A learned (head_dim x head_dim) map applied to the values, and a per-head gain."""

    def __init__(self, head_dim: int, num_heads: int):
        super().__init__()
        self.mix = nn.Linear(head_dim, head_dim)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(num_heads))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))


class MixedValuesAttention(zoo.Variant):
    name = "test_mixed_values"
    supports_causal = False
    params = {"mix": zoo.Param(True, bool, "mix the values")}

    def make_module(self, layer_idx, config, head_dim, num_heads):
        return ValueMixer(head_dim, num_heads) if self.mix else None

    def mixed(self, v, call):
        weights = self.layer_weights(call)
        return (weights.mix(v) * weights.gain[:, None, None]).to(v.dtype)

    def attend(self, q, k, v, call):
        mask = None if call.padding_mask is None else call.padding_mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, self.mixed(v, call), attn_mask=mask, scale=call.scaling)

    def reference(self, q, k, v, call):
        allowed = None if call.padding_mask is None else call.padding_mask[:, None, None, :]
        return softmax_attention(q, k, self.mixed(v, call), allowed, call.scaling)


class HiddenStatesProbe(zoo.LayerWeights):
    needs_hidden_states = True

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.seen = []


class HiddenStatesAttention(zoo.Variant):
    name = "test_hidden_states"

    def make_module(self, layer_idx, config, head_dim, num_heads):
        return HiddenStatesProbe(config.hidden_size)

    def attend(self, q, k, v, call):
        weights = self.layer_weights(call)
        weights.seen.append(weights.hidden_states.shape)
        return F.scaled_dot_product_attention(q, k, v, is_causal=call.causal, scale=call.scaling)


@pytest.fixture(autouse=True, scope="module")
def registered():
    for cls in (MixedValuesAttention, HiddenStatesAttention):
        zoo.register_variant(cls)
    yield
    for cls in (MixedValuesAttention, HiddenStatesAttention):
        zoo.unregister_variant(cls.name)


def _bert(**params):
    return transformers.BertModel(zoo.configure(transformers.BertConfig(**SMALL), "test_mixed_values", **params))


def _zoo_keys(model):
    return sorted(k for k in model.state_dict() if f".{WEIGHTS_NAME}." in k)


def _inputs():
    ids = torch.randint(3, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 13:] = 0
    return ids, mask


def test_from_config_attaches_one_module_per_layer_with_stable_keys():
    model = _bert()
    assert _zoo_keys(model) == [
        f"encoder.layer.{i}.attention.self.attention_zoo.{p}"
        for i in range(2)
        for p in ("calls", "gain", "mix.bias", "mix.weight")
    ]
    assert any(p is model.encoder.layer[1].attention.self.attention_zoo.gain for p in model.parameters())


def test_initialisation_is_deterministic_per_layer_and_leaves_the_global_generator_alone():
    torch.manual_seed(0)
    a = _bert()
    after_a = torch.randn(3)
    torch.manual_seed(0)
    b = _bert()
    torch.testing.assert_close(torch.randn(3), after_a)  # weights drawn from their own seed, not the global stream
    layer0, layer1 = (a.encoder.layer[i].attention.self.attention_zoo for i in (0, 1))
    assert not torch.equal(layer0.mix.weight, layer1.mix.weight), "layers draw from different seeds"
    torch.testing.assert_close(b.encoder.layer[0].attention.self.attention_zoo.mix.weight, layer0.mix.weight)
    torch.manual_seed(seed_for(zoo.get_variant_class("test_mixed_values")(), 1))
    torch.testing.assert_close(ValueMixer(8, 4).mix.weight, layer1.mix.weight)


def test_task_heads_and_decoders_get_weights_too():
    config = zoo.configure(transformers.LlamaConfig(**SMALL, num_key_value_heads=2), "test_hidden_states")
    model = transformers.LlamaForCausalLM(config)
    assert _zoo_keys(model) == [f"model.layers.{i}.self_attn.attention_zoo.proj.{p}" for i in (0, 1)
                                for p in ("bias", "weight")]
    config = zoo.configure(transformers.BertConfig(**SMALL), "test_mixed_values")
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    assert len(_zoo_keys(model)) == 8 and _zoo_keys(model)[0].startswith("bert.encoder.layer.0.")


def test_gradients_reach_the_weights_and_an_optimizer_trains_them():
    model = _bert()
    ids, mask = _inputs()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.encoder.layer[0].attention.self.attention_zoo.mix.weight.detach().clone()
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    for key, param in model.named_parameters():
        if WEIGHTS_NAME in key:
            assert param.grad is not None and param.grad.abs().max() > 1e-4, key
    optimizer.step()
    assert not torch.equal(model.encoder.layer[0].attention.self.attention_zoo.mix.weight, before)


def test_save_and_reload_identical(tmp_path):
    model = _bert().eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if WEIGHTS_NAME in key:
                param.add_(torch.randn_like(param))  # "trained": no longer the deterministic init
    ids, mask = _inputs()
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    for key in _zoo_keys(model):
        torch.testing.assert_close(reloaded.state_dict()[key], model.state_dict()[key], atol=0, rtol=0)
    torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).last_hidden_state, out)


def test_base_checkpoint_without_the_weights_gets_the_deterministic_init_and_one_log_line(tmp_path, caplog):
    torch.manual_seed(0)
    base = transformers.BertModel(transformers.BertConfig(**SMALL))
    base.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO):
        model, info = transformers.BertModel.from_pretrained(
            tmp_path, attn_implementation=zoo.IMPLEMENTATION, output_loading_info=True,
            config=zoo.configure(transformers.BertConfig.from_pretrained(tmp_path), "test_mixed_values"),
        )
    lines = [r.getMessage() for r in caplog.records if "attention-zoo" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "8 per-layer tensors" in lines[0] and "encoder.layer.*.attention.self.attention_zoo.mix.weight" in lines[0]
    assert not info["missing_keys"], "transformers' own 'newly initialized' report would repeat them"
    fresh = _bert()
    for key in _zoo_keys(fresh):
        torch.testing.assert_close(model.state_dict()[key], fresh.state_dict()[key], atol=0, rtol=0)
    torch.testing.assert_close(model.embeddings.word_embeddings.weight, base.embeddings.word_embeddings.weight)


def test_from_pretrained_in_bf16_casts_the_weights(tmp_path):
    _bert().save_pretrained(tmp_path)
    model = transformers.AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.encoder.layer[0].attention.self.attention_zoo.mix.weight.dtype == torch.bfloat16


def test_configure_on_a_built_model_attaches_replaces_and_removes():
    model = transformers.BertModel(transformers.BertConfig(**SMALL))
    assert not _zoo_keys(model)
    zoo.configure(model, "test_mixed_values")
    assert len(_zoo_keys(model)) == 8
    ids, mask = _inputs()
    assert torch.isfinite(model(input_ids=ids, attention_mask=mask).last_hidden_state).all()
    zoo.configure(model, "test_mixed_values", mix=False)
    assert not _zoo_keys(model)
    zoo.configure(model, "sdpa")
    assert not _zoo_keys(model)


def test_a_module_without_its_weights_raises_a_clear_error():
    model = _bert()
    del model.encoder.layer[0].attention.self._modules[WEIGHTS_NAME]
    ids, mask = _inputs()
    with pytest.raises(ValueError, match="learned per-layer weights.*zoo.configure"):
        model(input_ids=ids, attention_mask=mask)


def test_weights_that_ask_for_hidden_states_see_the_attention_input():
    model = transformers.DistilBertModel(
        zoo.configure(transformers.DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64),
                      "test_hidden_states")
    )
    assert [idx for _, idx, _ in attention_modules(model)] == [0, 1]
    ids, mask = _inputs()
    model(input_ids=ids, attention_mask=mask)
    for layer in model.transformer.layer:
        probe = layer.attention.attention_zoo
        assert probe.seen == [torch.Size([2, 20, 32])] and probe.hidden_states is None


def test_the_contract_suite_hands_kernels_their_weights_and_checks_them():
    weights = make_call(False, variant=zoo.get_variant_class("test_mixed_values")()).weights
    assert isinstance(weights, ValueMixer)
    torch.testing.assert_close(weights.mix.weight, make_weights(MixedValuesAttention()).mix.weight, atol=0, rtol=0)
    assert make_call(False, variant=zoo.get_variant_class("sdpa")()).weights is None
    for test in (
        contract.test_shape_and_dtype,
        contract.test_matches_reference_restricted_to_its_pattern,
        contract.test_gradients_are_finite_and_match_the_reference,
        contract.test_bf16_runs_without_nan,
        contract.test_learned_weights_get_gradients_and_reload_identically,
    ):
        test("test_mixed_values")


def test_the_weights_check_fails_for_weights_the_kernel_ignores():
    class IgnoredWeights(MixedValuesAttention):
        name = "test_ignored_weights"

        def mixed(self, v, call):
            return v

    zoo.register_variant(IgnoredWeights)
    try:
        with pytest.raises(AssertionError, match="gets no .* gradient"):
            contract.test_learned_weights_get_gradients_and_reload_identically("test_ignored_weights")
    finally:
        zoo.unregister_variant("test_ignored_weights")


class UndeclaredProbe(nn.Module):  # names the hook without subclassing zoo.LayerWeights: it would never be called
    needs_hidden_states = True


class UndeclaredHooksAttention(zoo.Variant):
    name = "test_undeclared_hooks"

    def make_module(self, layer_idx, config, head_dim, num_heads):
        return UndeclaredProbe()


def test_weights_naming_a_hook_without_declaring_it_are_refused():
    zoo.register_variant(UndeclaredHooksAttention)
    try:
        config = zoo.configure(transformers.BertConfig(**SMALL), "test_undeclared_hooks")
        with pytest.raises(TypeError, match="needs_hidden_states but is not a zoo.LayerWeights"):
            transformers.BertModel(config)
    finally:
        zoo.unregister_variant(UndeclaredHooksAttention.name)
