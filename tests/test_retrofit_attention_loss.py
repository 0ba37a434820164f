"""A retrofit's stage 1 by Hedgehog's attention loss (``transfer: {loss: attention}``) on a tiny random Llama: the
teacher's weights are the model's own softmax attention, training lowers the cross-entropy of a hedgehog ``linear``
layer's weights against them (the output error is still what the row reports), and variants without attention
weights, LoRA and unknown losses are refused naming ``transfer.loss``."""

from __future__ import annotations

import pytest
import torch
import transformers
import yaml
from test_retrofit import SMALL, one_thread  # noqa: F401  (one thread, autouse)

from zoo.plug.install import configure
from zoo.plug.spec import variant_for
from zoo.plug.weights import WEIGHTS_NAME, attention_modules
from zoo.retrofit import recipe
from zoo.retrofit.capture import capture
from zoo.retrofit.config import RetrofitConfigError, load_config
from zoo.retrofit.selection import attention_states, hybrid_layers
from zoo.retrofit.transfer import (
    TransferSettings,
    attention_cross_entropy,
    held_out_attention_loss,
    recorded_calls,
    softmax_weights,
    train_layer,
)

HEDGEHOG = {"variant": "linear", "params": {"feature_map": "hedgehog"}}
TRAIN, HELD_OUT = list(range(6)), [6, 7]


def _model(implementation: str = "sdpa", qk_scale: float = 1.0):
    """The tiny Llama, frozen, under the zoo's sdpa (or transformers' eager attention); ``qk_scale`` multiplies the q
    and k projections (a random model's attention is near uniform; x8 gives it an entropy of ~2.1 nats of 3.2)."""
    torch.manual_seed(0)
    implementation = "eager" if implementation == "eager" else None
    config = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 2}, attn_implementation=implementation)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    if implementation is None:
        configure(model, "sdpa")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def _captured(model, tmp_path):
    sequences = torch.randint(0, SMALL["vocab_size"], (8, 48), generator=torch.Generator().manual_seed(1))
    return sequences, capture(model, sequences, tmp_path / "acts", [0, 1])


def _converted(model, entry):
    original = attention_states(model)
    configure(model, "hybrid", layers=hybrid_layers(len(original), [0, 1], entry))
    modules = {idx: module for _, idx, module in attention_modules(model)}
    for layer, module in modules.items():
        module.load_state_dict(original[layer], strict=False)
    return modules


def test_the_teacher_is_the_models_own_softmax_attention(tmp_path):
    """softmax_weights of the q/k a layer's forward hands the kernel (rotary, GQA, the model's scaling, causal) are
    what transformers' eager attention returns for that layer."""
    model = _model()
    sequences, captured = _captured(model, tmp_path)
    eager = _model("eager")
    with torch.no_grad():
        want = eager(input_ids=sequences[:2], output_attentions=True).attentions
    modules = {idx: module for _, idx, module in attention_modules(model)}
    for layer in (0, 1):
        with torch.no_grad(), recorded_calls(modules[layer]) as seen:
            captured.call(modules[layer], layer, captured.batch(layer, [0, 1])[0])
        ((_, q, k, call),) = seen
        assert k.shape[1] == 2 and q.shape[1] == 4  # grouped keys reach the teacher unexpanded here (sdpa)
        torch.testing.assert_close(softmax_weights(q, k, call), want[layer], atol=1e-5, rtol=1e-4)
    assert "attend" not in vars(variant_for(model.config))  # the kernel is back after the recording
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=sequences[:2]).logits, eager(input_ids=sequences[:2]).logits, atol=1e-5, rtol=1e-4
        )


def test_cross_entropy_is_the_teachers_entropy_at_a_match():
    teacher = torch.softmax(torch.randn(2, 3, 5, 5, dtype=torch.float64), dim=-1).tril()
    teacher = teacher / teacher.sum(-1, keepdim=True)
    entropy = -(teacher * teacher.clamp_min(1e-300).log()).sum(-1).mean()
    torch.testing.assert_close(attention_cross_entropy(teacher, teacher), entropy)
    uniform = torch.ones_like(teacher).tril()
    assert attention_cross_entropy(uniform / uniform.sum(-1, keepdim=True), teacher) > entropy


def _teacher_entropy(module, captured, layer: int, rows: list[int]) -> float:
    """The floor of the cross-entropy: the teacher's own entropy on ``rows``."""
    with torch.no_grad(), recorded_calls(module) as seen:
        captured.call(module, layer, captured.batch(layer, rows)[0])
    ((_, q, k, call),) = seen
    teacher = softmax_weights(q, k, call)
    return float(attention_cross_entropy(teacher, teacher))


def test_attention_loss_lowers_the_hedgehog_layers_cross_entropy(tmp_path):
    """Held out, the KL to the teacher (the cross-entropy above its floor) falls 13 % in 30 steps here; on the
    training rows much more (6 random-token sequences: longer training overfits them)."""
    model = _model(qk_scale=8.0)
    _, captured = _captured(model, tmp_path)
    modules = _converted(model, HEDGEHOG)
    settings = TransferSettings(steps=30, learning_rate=3e-2, batch=2, loss="attention")
    for layer in (0, 1):
        start = {k: v.clone() for k, v in modules[layer]._modules[WEIGHTS_NAME].state_dict().items()}
        floor = _teacher_entropy(modules[layer], captured, layer, HELD_OUT)
        train_before = held_out_attention_loss(modules[layer], captured, layer, TRAIN)
        row = train_layer(modules[layer], captured, layer, TRAIN, HELD_OUT, settings)
        assert row["attention_loss_before"] > floor + 0.3  # identity maps start far from softmax's weights
        assert row["attention_loss_after"] - floor < 0.93 * (row["attention_loss_before"] - floor), row
        train_floor = _teacher_entropy(modules[layer], captured, layer, TRAIN)
        train_after = held_out_attention_loss(modules[layer], captured, layer, TRAIN)
        assert train_after - train_floor < 0.85 * (train_before - train_floor)
        assert row["error_before"] > 0 and row["error_after"] > 0  # the output error is still reported
        assert row["trained_parameters"] == sum(v.numel() for v in start.values())
        trained = modules[layer]._modules[WEIGHTS_NAME].state_dict()
        assert all(not torch.equal(trained[k], start[k]) for k in ("feature_q", "feature_k"))
        again = held_out_attention_loss(modules[layer], captured, layer, HELD_OUT)
        assert again == pytest.approx(row["attention_loss_after"], rel=1e-6)
        # the model's own projections stayed frozen: only the maps trained
        assert all(not p.requires_grad for p in modules[layer].parameters())


def test_a_variant_without_attention_weights_is_refused_before_training(tmp_path):
    model = _model()
    _, captured = _captured(model, tmp_path)
    modules = _converted(model, {"variant": "gated_deltanet", "params": {"short_conv": 4}})
    settings = TransferSettings(steps=2, loss="attention")
    with pytest.raises(ValueError, match=r"transfer\.loss: attention .* 'gated_deltanet' offers none"):
        train_layer(modules[0], captured, 0, TRAIN, HELD_OUT, settings)
    with pytest.raises(ValueError, match=r"transfer\.loss: 'mse' is not one of output, attention"):
        train_layer(modules[0], captured, 0, TRAIN, HELD_OUT, TransferSettings(steps=2, loss="mse"))


def _config(tmp_path, variant="linear", params=None, transfer=None):
    raw = {"model": "smollm2", "output_dir": str(tmp_path / "out"), "variant": variant,
           "variant_params": {"feature_map": "hedgehog"} if params is None else params,
           "transfer": transfer or {"steps": 5, "loss": "attention"}}  # fmt: skip
    path = tmp_path / "retrofit.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_config_takes_the_loss_and_keeps_default_fingerprints(tmp_path):
    cfg = load_config(_config(tmp_path))
    assert cfg.transfer.loss == "attention"
    output = load_config(_config(tmp_path, transfer={"steps": 5}))
    assert output.transfer.loss == "output"
    explicit = load_config(_config(tmp_path, transfer={"steps": 5, "loss": "output"}))
    assert recipe.fingerprint(explicit) == recipe.fingerprint(output) != recipe.fingerprint(cfg)


@pytest.mark.parametrize(("variant", "params", "transfer", "named"), [
    ("gated_deltanet", {"short_conv": 4}, None, r"transfer\.loss: attention .*'gated_deltanet' offers none.*"
                                                r"transfer\.loss: output"),
    ("dsa", {}, None, r"transfer\.loss: attention .*'dsa' offers none"),
    ("linear", None, {"loss": "mse"}, r"transfer\.loss: 'mse' is not one of output, attention"),
    ("linear", None, {"loss": "attention", "lora": {"r": 4}}, r"transfer\.loss: attention .*drop transfer\.lora"),
])  # fmt: skip
def test_config_refusals_name_transfer_loss(tmp_path, variant, params, transfer, named):
    with pytest.raises(RetrofitConfigError, match=named):
        load_config(_config(tmp_path, variant, params, transfer))
