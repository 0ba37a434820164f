"""``gates="keys"`` on ``gla`` (per channel and per head) and ``gated_deltanet``: Liger's gate (Lan et al. 2025) made
from the layer's own keys, log α = logsigmoid(Pool(k)) / 16, no gate weights. The gate equals the hand-written
formula on random keys (read before the short convolution), every log α ≤ 0 and padded tokens get α = 1, the kernel
equals the recurrence, greedy decoding with the cache equals decoding without it in a tiny Llama (GQA; ``gla``'s
prefill then decode against one forward is in tests/variants/test_gla.py), the learned weights left (convolution,
norm, β) train and reload, a saved model reloads the setting and holds no decay weights, and bad values fail naming
the parameter and the fix."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from zoo.variants.gated_deltanet import GatedDeltaNetAttention
from zoo.variants.gla import GLAAttention

import zoo
from zoo import testing
from zoo.modules import key_log_decay
from zoo.plug.weights import WEIGHTS_NAME
from zoo.testing import run_variant

SETTINGS = [("gla", {"decay": "channel"}), ("gla", {"decay": "scalar"}), ("gated_deltanet", {})]
IDS = ["gla-channel", "gla-scalar", "gated_deltanet"]


def variant(name: str, **params):
    return testing.make_variant(name, gates="keys", **params)


def log_decay_of(v, q, k, vals, call) -> torch.Tensor:
    return v.prepare(q, k, vals, call)[-1]  # gla: (q, k, v, log α); gated_deltanet: (q, k, v, β, log α)


def liger_by_hand(k: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """log σ(x) / 16 = −log(1 + e^(−x)) / 16 of each key channel, or of the mean of each head's channels (fp64)."""
    x = k.double() if per_channel else k.double().sum(-1) / k.shape[-1]
    return -torch.log1p(torch.exp(-x)) / 16


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
@pytest.mark.parametrize("short_conv", [0, 4])
def test_the_gate_is_liger_formula_of_the_keys_as_they_arrive(name, params, short_conv):
    v = variant(name, short_conv=short_conv, **params)
    q, k, vals, _ = testing.make_inputs(padding=None)
    call = testing.make_call(True, None, variant=v)
    got = log_decay_of(v, q, k, vals, call)
    per_channel = params.get("decay") == "channel"
    want = liger_by_hand(k, per_channel)
    assert got.shape == want.shape == ((*k.shape[:3], k.shape[-1]) if per_channel else k.shape[:3])
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(key_log_decay(k, per_channel), want.float(), atol=1e-6, rtol=1e-6)
    # the keys decide it: other keys, another gate (the hidden states are not read)
    assert not torch.allclose(log_decay_of(v, q, k.flip(-2), vals, call), got)


def test_a_gate_of_zero_keys_is_the_documented_start():
    k = torch.zeros(1, 2, 3, 4)
    for per_channel in (True, False):
        torch.testing.assert_close(
            key_log_decay(k, per_channel), torch.full_like(k if per_channel else k[..., 0], -math.log(2) / 16)
        )


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
@pytest.mark.parametrize("padding", ["left", "right"])
def test_every_log_decay_is_at_most_zero_and_padded_tokens_keep_the_state(name, params, padding):
    v = variant(name, **params)
    q, k, vals, mask = testing.make_inputs(padding=padding)
    k = 40 * k  # keys far into both tails: logsigmoid saturates at 0 (α = 1), never above
    log_decay = log_decay_of(v, q, k, vals, testing.make_call(True, mask, variant=v))
    real = mask[:, None] if log_decay.dim() == 3 else mask[:, None, :, None]
    real = real.expand_as(log_decay)
    assert (log_decay <= 0).all() and torch.isfinite(log_decay).all()
    assert (log_decay[~real] == 0).all() and (log_decay[real] < 0).any()


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
@pytest.mark.parametrize("padding", ["left", "right"])
def test_the_chunked_kernel_equals_the_recurrence(name, params, padding):
    v = variant(name, chunk_size=8, **params)
    q, k, vals, mask = testing.make_inputs(padding=padding)
    call = testing.make_call(True, mask, variant=v)
    out = run_variant(v, q, k, vals, call)
    testing.assert_matches_reference(
        v, testing.real_rows(out, mask), testing.real_rows(testing.reference(v, q, k, vals, call), mask)
    )


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
def test_greedy_decoding_with_the_cache_equals_decoding_without_it(name, params):
    testing.assert_decodes_like_the_full_forward(name, gates="keys", **params)


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
def test_a_saved_model_reloads_the_setting_and_holds_no_decay_weights(name, params, tmp_path):
    model = testing.causal_lm(name, gates="keys", **params)
    ids, mask = testing.decode_prompts()
    reloaded = testing.assert_reloads_identically(
        model, {"input_ids": ids, "attention_mask": mask}, path=tmp_path, atol=0, rtol=0
    )
    saved = json.loads((tmp_path / "config.json").read_text())["attention_zoo"]
    assert saved["variant"] == name and saved["params"]["gates"] == "keys"
    keys = [key for key in reloaded.state_dict() if f".{WEIGHTS_NAME}." in key]
    assert keys and not [key for key in keys if ".decay." in key]  # the convolution, norm (and β) only
    learned = testing.causal_lm(name, **params)
    assert [key for key in learned.state_dict() if f".{WEIGHTS_NAME}.decay." in key]  # the default keeps its gate


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
def test_the_remaining_weights_train_and_reload(name, params):
    model = transformers.AutoModelForCausalLM.from_config(
        testing.tiny_model_config("llama", name, gates="keys", **params)
    )
    ids, mask = testing.model_inputs()
    testing.assert_weights_train_and_reload(model, {"input_ids": ids, "attention_mask": mask})


def test_gla_with_key_gates_and_nothing_else_learned_has_no_weights():
    v = GLAAttention(gates="keys", short_conv=0, output_norm=False)
    assert testing.make_weights(v) is None
    q, k, vals, mask = testing.make_inputs(padding="left")
    call = testing.make_call(True, mask, variant=v)
    testing.assert_matches_reference(
        v,
        testing.real_rows(run_variant(v, q, k, vals, call), mask),
        testing.real_rows(testing.reference(v, q, k, vals, call), mask),
    )
    assert not testing.make_weights(GLAAttention(gates="keys")).needs_hidden_states  # nothing reads them


@pytest.mark.parametrize("name", ["gla", "gated_deltanet"])
def test_an_unknown_gates_value_fails_naming_the_parameter(name):
    with pytest.raises(zoo.VariantParameterError, match=r"'gates' = 'liger'.*one of 'learned', 'keys'"):
        zoo.configure(transformers.LlamaConfig(), name, gates="liger")


def test_key_gates_with_a_fixed_decay_fail_naming_the_fix():
    with pytest.raises(zoo.VariantParameterError, match=r"'gates' = 'keys'.*decay='fixed'.*decay='channel'"):
        zoo.configure(transformers.LlamaConfig(), "gla", gates="keys", decay="fixed")
    with pytest.raises(zoo.VariantParameterError, match="decay='fixed'"):
        GLAAttention(gates="keys", decay="fixed")


def test_the_default_is_the_learned_gate():
    assert GLAAttention().gates == GatedDeltaNetAttention().gates == "learned"
