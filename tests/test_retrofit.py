"""zoo.retrofit on a tiny random Llama: capture, attention transfer (with and without LoRA), layer selection by swap
KL / error / pattern, a layout saved and reloaded, the config checks, and the data windows a retrofit reads."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml

import zoo
from zoo.data.lm import spread_windows
from zoo.plug.install import configure
from zoo.plug.weights import WEIGHTS_NAME, attention_modules
from zoo.retrofit.capture import capture
from zoo.retrofit.config import RetrofitConfigError, load_config
from zoo.retrofit.selection import (
    apply_layout,
    attention_states,
    check_layout,
    divergence,
    hybrid_layers,
    kept_layers,
    next_token_logprobs,
    swap_kl,
)
from zoo.retrofit.transfer import TransferSettings, held_out_error, normalized_error, train_layer

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128)  # fmt: skip
ENTRY = {"variant": "gated_deltanet", "params": {"short_conv": 4}}
LAYERS = [0, 1, 2, 3]
TRAIN, HELD_OUT = list(range(6)), [6, 7]  # rows of the 8 captured sequences
SETTINGS = TransferSettings(steps=60, learning_rate=3e-3, batch=2)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _model(o_proj_scale: dict[int, float] | None = None):
    """The tiny Llama under the zoo's sdpa (the original attention), frozen; ``o_proj_scale``: layer -> factor."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    with torch.no_grad():
        for layer, factor in (o_proj_scale or {}).items():
            model.model.layers[layer].self_attn.o_proj.weight.mul_(factor)
    configure(model, "sdpa")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def _sequences(count: int = 8, length: int = 64) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (count, length), generator=torch.Generator().manual_seed(1))


def _modules(model) -> dict[int, torch.nn.Module]:
    return {idx: module for _, idx, module in attention_modules(model)}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _transfer(model, captured, entry, settings, layers=LAYERS, steps_of: dict[int, int] | None = None):
    """What recipe.stage1 does between the capture and the swap KL: ``(rows, transferred, original)``."""
    original = attention_states(model)
    configure(model, "hybrid", layers=hybrid_layers(len(original), layers, entry))
    modules = _modules(model)
    rows, transferred = {}, {}
    for layer in layers:
        modules[layer].load_state_dict(original[layer], strict=False)
        layer_settings = settings
        if steps_of and layer in steps_of:
            layer_settings = TransferSettings(**{**vars(settings), "steps": steps_of[layer]})
        rows[layer] = train_layer(modules[layer], captured, layer, TRAIN, HELD_OUT, layer_settings)
        transferred[layer] = {k: v.detach().clone() for k, v in modules[layer].state_dict().items()}
    return rows, transferred, original


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread: these tensors are tiny, and two threads on a busy 2-core machine spin-wait 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stage1(one_thread, tmp_path_factory):
    """The gated DeltaNet transfer of every layer of the tiny model (60 steps each), and what it ran on."""
    model = _model()
    sequences = _sequences()
    captured = capture(model, sequences, tmp_path_factory.mktemp("stage1") / "acts", LAYERS)
    rows, transferred, original = _transfer(model, captured, ENTRY, SETTINGS)
    return {"model": model, "captured": captured, "sequences": sequences, "rows": rows,
            "transferred": transferred, "original": original}


# ---------------------------------------------------------------------------------------------------
# capture


def test_capture_records_each_layers_input_and_output(tmp_path):
    model = _model()
    sequences = _sequences()
    modules = _modules(model)
    layers = [1, 3]
    hooks_before = {i: (len(m._forward_hooks), len(m._forward_pre_hooks)) for i, m in modules.items()}
    model.train()  # capture runs in eval mode and puts the mode back
    captured = capture(model, sequences, tmp_path / "acts", layers)
    assert model.training
    model.eval()
    assert {i: (len(m._forward_hooks), len(m._forward_pre_hooks)) for i, m in modules.items()} == hooks_before

    # what the modules see and give, recorded independently with hooks of our own
    seen: dict[int, list] = {i: [] for i in layers}
    gave: dict[int, list] = {i: [] for i in layers}
    handles = []
    for i in layers:
        handles.append(modules[i].register_forward_pre_hook(
            lambda m, args, kwargs, i=i: seen[i].append((args[0] if args else kwargs["hidden_states"])[0].clone()),
            with_kwargs=True))  # fmt: skip
        handles.append(modules[i].register_forward_hook(lambda m, args, out, i=i: gave[i].append(out[0][0].clone())))
    for row in sequences:
        _logits(model, row[None])
    for handle in handles:
        handle.remove()

    assert captured.layers == layers and (captured.count, captured.length, captured.hidden) == (8, 64, 64)
    assert sorted(captured.inputs) == sorted(captured.outputs) == layers
    for i in layers:
        assert captured.inputs[i].shape == captured.outputs[i].shape == (8, 64, 64)
        np.testing.assert_allclose(captured.inputs[i], torch.stack(seen[i]).numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(captured.outputs[i], torch.stack(gave[i]).numpy(), rtol=0, atol=1e-5)
        # the module called again with the kept arguments (all rows at once) gives the captured outputs
        inputs, outputs = captured.batch(i, list(range(8)))
        with torch.no_grad():
            again = captured.call(modules[i], i, inputs)
        torch.testing.assert_close(again, outputs, rtol=0, atol=1e-5)
        picked_in, picked_out = captured.batch(i, [5, 2])
        torch.testing.assert_close(picked_out, torch.from_numpy(np.asarray(captured.outputs[i][[5, 2]])))
        torch.testing.assert_close(picked_in[1], torch.stack(seen[i])[2], rtol=0, atol=1e-5)
    assert not torch.allclose(torch.from_numpy(np.asarray(captured.outputs[1])),
                              torch.from_numpy(np.asarray(captured.outputs[3])))  # fmt: skip

    files = sorted(path.name for path in (tmp_path / "acts").iterdir())
    assert files == ["layer1_in.npy", "layer1_out.npy", "layer3_in.npy", "layer3_out.npy"]
    data = 2 * len(layers) * 8 * 64 * 64 * 4
    assert captured.disk_bytes == data == sum(a.nbytes for a in [*captured.inputs.values(), *captured.outputs.values()])
    on_disk = sum(path.stat().st_size for path in (tmp_path / "acts").iterdir())
    assert data <= on_disk <= data + 4 * 4096  # the .npy headers
    captured.delete()
    assert not (tmp_path / "acts").exists()


def test_capture_of_every_layer_by_default_and_unknown_layers_refused(tmp_path):
    model = _model()
    captured = capture(model, _sequences(2, 16), tmp_path / "all")
    assert captured.layers == LAYERS
    with pytest.raises(ValueError, match=r"no attention layers \[4, 9\].*0\.\.3"):
        capture(model, _sequences(2, 16), tmp_path / "bad", [0, 9, 4])


# ---------------------------------------------------------------------------------------------------
# transfer


def test_normalized_error_is_one_for_the_mean_and_zero_for_exact():
    teacher = torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(0)) * 5 + 2
    mean = teacher.mean().expand_as(teacher)
    assert float(normalized_error(mean, teacher)) == pytest.approx(1.0, abs=1e-6)
    assert float(normalized_error(teacher.clone(), teacher)) == 0.0
    assert float(normalized_error(teacher + 1.5, teacher)) == pytest.approx(1.5**2 / float(teacher.var(correction=0)),
                                                                             rel=1e-5)  # fmt: skip
    noise = torch.randn(teacher.shape, generator=torch.Generator().manual_seed(1))
    assert float(normalized_error(7 * (teacher + noise), 7 * teacher)) == pytest.approx(
        float(normalized_error(teacher + noise, teacher)), rel=1e-5)  # scale-free
    assert normalized_error(teacher.half(), teacher).dtype == torch.float32


def test_transfer_lowers_the_held_out_error_of_every_layer(stage1):
    rows, transferred, original = stage1["rows"], stage1["transferred"], stage1["original"]
    assert sorted(rows) == LAYERS
    for layer, row in rows.items():
        assert row["layer"] == layer and row["steps"] == 60 and row["tokens"] == 60 * 2 * 64
        assert math.isfinite(row["error_before"]) and math.isfinite(row["error_after"])
        assert row["error_after"] < 0.8 * row["error_before"], row
        variant_keys = [k for k in transferred[layer] if k.startswith(f"{WEIGHTS_NAME}.")]
        assert variant_keys and row["trained_parameters"] == sum(transferred[layer][k].numel() for k in variant_keys)
        # only the variant's weights trained: the projections are the original ones
        for name in PROJECTIONS:
            torch.testing.assert_close(transferred[layer][f"{name}.weight"], original[layer][f"{name}.weight"],
                                       rtol=0, atol=0)  # fmt: skip
        assert set(transferred[layer]) == set(original[layer]) | set(variant_keys)


def test_held_out_error_is_the_pooled_normalized_error_of_the_trained_module(stage1):
    model, captured, rows = stage1["model"], stage1["captured"], stage1["rows"]
    modules = _modules(model)
    for layer in (0, 3):
        inputs, teacher = captured.batch(layer, HELD_OUT)
        with torch.no_grad():
            pooled = float(normalized_error(captured.call(modules[layer], layer, inputs), teacher))
        assert held_out_error(modules[layer], captured, layer, HELD_OUT) == pytest.approx(pooled, rel=1e-4)
        assert held_out_error(modules[layer], captured, layer, HELD_OUT, batch=2) == pytest.approx(pooled, rel=1e-4)
        assert pooled == pytest.approx(rows[layer]["error_after"], rel=1e-4)


def test_transfer_with_lora_merges_the_adapters_into_the_projections(tmp_path):
    pytest.importorskip("peft")
    model = _model()
    captured = capture(model, _sequences(), tmp_path / "acts", [0, 2])
    settings = TransferSettings(steps=60, learning_rate=3e-3, batch=2, lora={"r": 4})
    rows, transferred, original = _transfer(model, captured, ENTRY, settings, layers=[0, 2])
    modules = _modules(model)
    r, hidden, kv = 4, SMALL["hidden_size"], 2 * SMALL["hidden_size"] // SMALL["num_attention_heads"]
    lora_count = r * (hidden + hidden) + 2 * r * (hidden + kv)  # q, k and v
    for layer in (0, 2):
        module, row = modules[layer], rows[layer]
        assert not [n for n, _ in module.named_modules() if "lora" in n.lower()]
        assert not [k for k in module.state_dict() if "lora_" in k or "base_layer" in k]
        assert all(type(getattr(module, name)) is torch.nn.Linear for name in PROJECTIONS)
        variant_count = sum(p.numel() for p in module._modules[WEIGHTS_NAME].parameters())
        assert row["trained_parameters"] == variant_count + lora_count
        assert row["error_after"] < 0.8 * row["error_before"], row
        for name in ("q_proj", "k_proj", "v_proj"):
            assert not torch.allclose(transferred[layer][f"{name}.weight"], original[layer][f"{name}.weight"])
        torch.testing.assert_close(transferred[layer]["o_proj.weight"], original[layer]["o_proj.weight"],
                                   rtol=0, atol=0)  # fmt: skip
        assert not any(p.requires_grad for p in module.parameters())
    # the merged state is the whole transfer: loaded into a fresh hybrid model it scores the reported error
    fresh = _model()
    configure(fresh, "hybrid", layers=hybrid_layers(4, [0, 2], ENTRY))
    module = _modules(fresh)[2]
    module.load_state_dict(transferred[2], strict=True)
    assert held_out_error(module, captured, 2, HELD_OUT) == pytest.approx(rows[2]["error_after"], rel=1e-4)


def test_zero_steps_changes_nothing(stage1):
    model = _model()
    captured = stage1["captured"]
    settings = TransferSettings(steps=0, learning_rate=3e-3, batch=2)
    configure(model, "hybrid", layers=hybrid_layers(4, [1], ENTRY))
    module = _modules(model)[1]
    before = {k: v.clone() for k, v in module.state_dict().items()}
    row = train_layer(module, captured, 1, TRAIN, HELD_OUT, settings)
    assert row["error_after"] == row["error_before"] == pytest.approx(stage1["rows"][1]["error_before"], rel=1e-5)
    assert row["steps"] == 0 and row["tokens"] == 0
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_gla_transfer_lowers_the_error_too(tmp_path):
    model = _model()
    captured = capture(model, _sequences(), tmp_path / "acts", LAYERS)
    rows, transferred, _ = _transfer(model, captured, {"variant": "gla", "params": {"short_conv": 4}}, SETTINGS)
    for row in rows.values():
        assert row["error_after"] < 0.7 * row["error_before"], row
    assert all(any(k.startswith(f"{WEIGHTS_NAME}.") for k in state) for state in transferred.values())


# ---------------------------------------------------------------------------------------------------
# selection


KL = {0: 0.1, 1: 0.5, 2: 0.05, 3: 0.9, 4: 0.2, 5: 0.3, 6: 0.01, 7: 0.4}
ERROR = {0: 0.9, 1: 0.1, 2: 0.8, 3: 0.2, 4: 0.3, 5: 0.4, 6: 0.5, 7: 0.05}


def test_kept_layers_by_pattern_list_and_measure():
    assert kept_layers({"name": "every4", "every": 4}, 8) == [3, 7]
    assert kept_layers({"every": 4, "offset": 0}, 8) == [0, 4]
    assert kept_layers({"every": 2}, 8) == [1, 3, 5, 7]
    assert kept_layers({"every": 3, "offset": 1}, 8) == [1, 4, 7]
    assert kept_layers({"every": 1}, 4) == [0, 1, 2, 3]
    assert kept_layers({"keep": [2, 0]}, 8) == [0, 2]
    assert kept_layers({"keep": []}, 8) == []
    assert kept_layers({"keep_full": 2, "by": "kl"}, 8, KL, ERROR) == [1, 3]
    assert kept_layers({"keep_full": 2}, 8, KL) == [1, 3]  # kl is the default measure
    assert kept_layers({"keep_full": 3, "by": "kl"}, 8, KL, ERROR) == [1, 3, 7]
    assert kept_layers({"keep_full": 0.25, "by": "kl"}, 8, KL) == [1, 3]
    assert kept_layers({"keep_full": 0.5, "by": "kl"}, 8, KL) == [1, 3, 5, 7]
    assert kept_layers({"keep_full": 2, "by": "error"}, 8, KL, ERROR) == [0, 2]
    assert kept_layers({"keep_full": 0}, 8) == []
    assert kept_layers({"name": "none"}, 8) == []
    assert kept_layers({"keep_full": 8, "by": "error"}, 8, error=ERROR) == list(range(8))
    assert kept_layers({"keep_full": 0.125}, 4, {0: 0.1, 1: 0.3, 2: 0.2, 3: 0.0}) == [1]  # 0.5 layers: rounds up
    assert kept_layers({"keep_full": 0.375}, 4, {0: 0.1, 1: 0.3, 2: 0.2, 3: 0.0}) == [1, 2]


def test_keep_full_ranks_only_the_layers_stage1_converted():
    """With `layers:` a subset, the budget goes to the converted layers with the largest KL; the others stay full."""
    assert kept_layers({"keep_full": 2, "by": "kl"}, 8, {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4}) == [2, 3]
    with pytest.raises(ValueError, match="keep_full=5 is more than the 4 layers stage 1 converted"):
        kept_layers({"keep_full": 5}, 8, {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4})


@pytest.mark.parametrize("layout, count, named", [
    ({"name": "x", "evry": 4}, 8, "evry"),
    ({"every": 4, "keep": [0]}, 8, r"\['every', 'keep'\]"),
    ({"keep_full": 2, "every": 4}, 8, r"\['keep_full', 'every'\]"),
    ({"every": 0}, 8, "every=0"),
    ({"every": -4}, 8, "every=-4"),
    ({"every": "4"}, 8, "every='4'"),
    ({"every": 2.0}, 8, "every=2.0"),
    ({"keep": [0, 8]}, 8, r"keep=\[0, 8\]"),
    ({"keep": [-1]}, 8, "keep="),
    ({"keep_full": 9}, 8, "keep_full=9"),
    ({"keep_full": -1}, 8, "keep_full=-1"),
    ({"keep_full": 1.5}, 8, "keep_full=1.5"),
    ({"keep_full": "two"}, 8, "keep_full='two'"),
    ({"keep_full": 2, "by": "loss"}, 8, "by='loss'"),
    ({"keep_full": True}, 8, "keep_full=True"),
    ({"every": 4, "offset": 4}, 8, "offset=4"),
    ({"every": 4, "offset": -1}, 8, "offset=-1"),
    ({"offset": 2}, 8, "offset=2 goes with every"),
])  # fmt: skip
def test_kept_layers_refusals_name_the_key(layout, count, named):
    with pytest.raises(ValueError, match=named):
        kept_layers(layout, count, KL, ERROR)


def test_check_layout_names_where_and_measure_needs_scores():
    with pytest.raises(ValueError, match=r"layouts\[3\].*\['stride'\]"):
        check_layout({"name": "a", "stride": 2}, "layouts[3]")
    check_layout({"name": "a", "keep_full": 0.25, "by": "error"}, "ok")
    with pytest.raises(ValueError, match="keep_full by kl needs the kl"):
        kept_layers({"keep_full": 2}, 8)
    with pytest.raises(ValueError, match="keep_full by error needs the error"):
        kept_layers({"keep_full": 2, "by": "error"}, 8, kl=KL)


def test_hybrid_layers_puts_the_entry_where_converted():
    entry = {"variant": "gated_deltanet", "params": {"short_conv": 4}}
    layers = hybrid_layers(4, [0, 2], entry)
    assert layers == [entry, "sdpa", entry, "sdpa"]
    layers[0]["variant"] = "gla"
    assert entry["variant"] == "gated_deltanet" and layers[2]["variant"] == "gated_deltanet"  # copies
    assert hybrid_layers(3, [], ENTRY) == ["sdpa"] * 3


def test_swap_kl_finds_the_layer_whose_replacement_moves_the_output_most(tmp_path):
    """Layer 2 is planted: the other layers' attention outputs are scaled down 20x (the transfer's normalized error is
    scale-free, so they transfer as well as it does, but replacing them moves the residual stream 20x less)."""
    planted = 2
    model = _model({i: 0.05 for i in LAYERS if i != planted})
    sequences = _sequences()
    held_out = sequences[HELD_OUT]
    original_logits = _logits(model, held_out)
    captured = capture(model, sequences, tmp_path / "acts", LAYERS)
    settings = TransferSettings(steps=30, learning_rate=3e-3, batch=2)
    rows, transferred, original = _transfer(model, captured, ENTRY, settings)
    apply_layout(model, [], ENTRY, transferred, original)
    teacher = next_token_logprobs(model, held_out)
    assert teacher.shape == (2, 63, SMALL["vocab_size"])
    torch.testing.assert_close(teacher, torch.log_softmax(original_logits[:, :-1], -1), rtol=0, atol=1e-5)
    itself = divergence(model, held_out, teacher)
    assert abs(itself["kl"]) < 1e-6
    assert itself["perplexity"] == pytest.approx(
        math.exp(-float(teacher.gather(-1, held_out[:, 1:, None]).mean())), rel=1e-5)

    kl = swap_kl(model, LAYERS, ENTRY, transferred, original, held_out, teacher)
    assert sorted(kl) == LAYERS and all(value > 0 for value in kl.values())
    assert kl[planted] > 5 * max(value for i, value in kl.items() if i != planted), kl
    assert kept_layers({"keep_full": 1, "by": "kl"}, 4, kl) == [planted]
    # swapping one layer is what the model scores with that layer alone converted
    apply_layout(model, [1], ENTRY, transferred, original)
    assert divergence(model, held_out, teacher)["kl"] == pytest.approx(kl[1], rel=1e-5)
    # swap_kl leaves the original model behind
    kl_again = swap_kl(model, [3], ENTRY, transferred, original, held_out, teacher)
    assert kl_again[3] == pytest.approx(kl[3], rel=1e-5)
    torch.testing.assert_close(_logits(model, held_out), original_logits, rtol=0, atol=1e-5)
    assert [entry["variant"] for entry in model.config.attention_zoo["params"]["layers"]] == ["sdpa"] * 4


# ---------------------------------------------------------------------------------------------------
# a layout, saved and reloaded


def test_apply_layout_saves_and_reloads_the_same_model(stage1, tmp_path):
    transferred, original = stage1["transferred"], stage1["original"]
    ids = stage1["sequences"][HELD_OUT]
    model = _model()
    original_logits = _logits(model, ids)
    layers = apply_layout(model, [0, 1, 2], ENTRY, transferred, original)
    assert layers == [ENTRY, ENTRY, ENTRY, "sdpa"]
    modules = _modules(model)
    for layer in LAYERS:
        state = transferred[layer] if layer < 3 else original[layer]
        assert set(modules[layer].state_dict()) == set(state)
        for key, value in modules[layer].state_dict().items():
            torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    logits = _logits(model, ids)
    assert not torch.allclose(logits, original_logits, atol=1e-3)  # the converted layers run the variant
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_logits(reloaded, ids), logits, rtol=0, atol=1e-5)
    spec = reloaded.config.attention_zoo
    assert spec["variant"] == "hybrid"
    assert spec["params"]["layers"] == [ENTRY, ENTRY, ENTRY, {"variant": "sdpa", "params": {}}]
    assert zoo.variant_for(reloaded.config).part(0).name == "gated_deltanet"
    # back to the original: every layer kept
    apply_layout(model, [], ENTRY, transferred, original)
    torch.testing.assert_close(_logits(model, ids), original_logits, rtol=0, atol=1e-5)


def test_apply_layout_refuses_a_layer_not_transferred(stage1):
    model = _model()
    some = {0: stage1["transferred"][0], 3: stage1["transferred"][3]}
    with pytest.raises(ValueError, match=r"layers \[1, 2\] were not transferred.*\[0, 3\]"):
        apply_layout(model, [0, 1, 2], ENTRY, some, stage1["original"])


# ---------------------------------------------------------------------------------------------------
# config


def _config(tmp_path, **changes):
    raw = {"model": "smollm2", "output_dir": str(tmp_path / "out"), "variant": "gated_deltanet",
           "variant_params": {"short_conv": 4}, "seed": 3,
           "data": {"sequence_length": 128, "train_sequences": 4, "held_out_sequences": 1},
           "transfer": {"steps": 5, "learning_rate": 1.0e-3, "batch": 1, "lora": {"r": 4}},
           "layouts": [{"name": "every4", "every": 4}, {"name": "selected", "keep_full": 2, "by": "kl"}]}  # fmt: skip
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path = tmp_path / "retrofit.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_config_round_trips(tmp_path):
    cfg = load_config(_config(tmp_path))
    assert cfg.entry == ENTRY
    assert cfg.model == "smollm2" and cfg.output_dir == tmp_path / "out" and cfg.seed == 3
    assert cfg.layouts == [{"name": "every4", "every": 4}, {"name": "selected", "keep_full": 2, "by": "kl"}]
    assert cfg.transfer == TransferSettings(steps=5, learning_rate=1e-3, batch=1, lora={"r": 4}, seed=3)
    assert cfg.data_setting("sequence_length") == 128 and cfg.data_setting("held_out_sequences") == 1
    assert cfg.stage2 is None and cfg.eval is None and cfg.layers is None and cfg.device is None
    assert cfg.source["variant"] == "gated_deltanet"
    moved = load_config(_config(tmp_path), {"output_dir": str(tmp_path / "elsewhere"), "seed": None})
    assert moved.output_dir == tmp_path / "elsewhere" and moved.seed == 3


def test_config_defaults(tmp_path):
    cfg = load_config(_config(tmp_path, data=None, transfer=None, layouts=None, variant_params=None, seed=None))
    assert cfg.entry == {"variant": "gated_deltanet", "params": {}}
    assert cfg.data_setting("sequence_length") == 1024 and cfg.data_setting("train_sequences") == 16
    assert cfg.layouts == [{"name": "selected", "keep_full": 0.25}]
    assert cfg.transfer == TransferSettings()
    full = load_config(_config(tmp_path, stage2={"max_steps": 2, "processes": 2}, eval={"config": "e.yaml"},
                               layers=[1, 2], device="cuda"))  # fmt: skip
    assert full.stage2 == {"max_steps": 2, "processes": 2} and full.eval == {"config": "e.yaml"}
    assert full.layers == [1, 2] and full.device == "cuda"


NON_CAUSAL = sorted(name for name in zoo.list_variants() if not zoo.get_variant_class(name)().supports_causal)


@pytest.mark.parametrize("changes, named", [
    ({"modle": "smollm2"}, "modle"),
    ({"variant": None}, "`variant` is missing"),
    ({"output_dir": None}, "`output_dir` is missing"),
    ({"data": {"sequence_length": 64, "seq_len": 64}}, "seq_len"),
    ({"transfer": {"steps": 5, "stepz": 5}}, "stepz"),
    ({"transfer": {"seed": 1}}, "seed"),
    ({"variant": NON_CAUSAL[0], "variant_params": {}}, f"variant '{NON_CAUSAL[0]}' has no causal attention"),
    ({"layouts": [{"name": "a", "every": 4}, {"name": "a", "keep_full": 2}]}, r"layout names \['a', 'a'\] repeat"),
    ({"layouts": [{"name": "a", "every": 4}, {"every": 2}]}, r"layouts\[1\] needs a name"),
    ({"layouts": ["every4"]}, r"layouts\[0\] needs a name"),
    ({"stage2": {"model_name_or_path": "x", "max_steps": 2}}, r"stage2 sets \['model_name_or_path'\]"),
    ({"stage2": {"variant": "gla", "output_dir": "x"}}, r"stage2 sets \['output_dir', 'variant'\]"),
    ({"stage2": {"max_stepz": 2, "processes": 2}}, r"stage2 has keys \['max_stepz'\]"),
    ({"stage2": "max_steps=2"}, "stage2 must be a mapping"),
    ({"eval": {"contestants": []}}, "eval needs `config"),
])  # fmt: skip
def test_config_refusals_name_the_key(tmp_path, changes, named):
    with pytest.raises(RetrofitConfigError, match=named):
        load_config(_config(tmp_path, **changes))


def test_config_layout_refusals_name_the_layout(tmp_path):
    with pytest.raises(RetrofitConfigError, match=r"layouts\[1\].*\['keep_full', 'every'\]"):
        load_config(_config(tmp_path, layouts=[{"name": "a", "every": 4}, {"name": "b", "every": 4, "keep_full": 2}]))
    with pytest.raises(RetrofitConfigError, match="variant 'no_such_variant'"):
        load_config(_config(tmp_path, variant="no_such_variant"))
    with pytest.raises(RetrofitConfigError, match="by='loss'"):
        load_config(_config(tmp_path, layouts=[{"name": "a", "keep_full": 2, "by": "loss"}]))


def test_non_causal_variants_exist():
    assert {"linformer", "nystromformer"} <= set(NON_CAUSAL)


# ---------------------------------------------------------------------------------------------------
# data


def test_spread_windows_alternate_books_at_even_offsets():
    books = [list(range(1000)), list(range(10_000, 10_500))]
    windows = spread_windows(books, 50, 6)
    # book 0: 20 slots, 3 windows 6 slots apart; book 1: 10 slots, 3 windows 3 slots apart
    starts = [(0, 0), (1, 0), (0, 300), (1, 150), (0, 600), (1, 300)]
    assert windows == [books[b][s : s + 50] for b, s in starts]
    assert spread_windows(books, 50, 5) == windows[:5]
    assert all(len(w) == 50 for w in spread_windows(books, 50, 7))  # 4 per book, the last one left out
    one = spread_windows([list(range(100))], 10, 10)
    assert one == [list(range(i, i + 10)) for i in range(0, 100, 10)]


def test_spread_windows_refuses_too_few_tokens_with_the_hint():
    with pytest.raises(ValueError, match=r"a Gutenberg validation book has 120 tokens, too few for 3 windows of 50; "
                                         "lower data"):  # fmt: skip
        spread_windows([list(range(1000)), list(range(120))], 50, 6, "a Gutenberg validation book", "lower data")
    with pytest.raises(ValueError, match="lower the count or the length"):
        spread_windows([list(range(99))], 50, 2)


def test_every_shipped_retrofit_config_loads():
    repo = Path(__file__).resolve().parents[1]
    shipped = sorted((repo / "recipes" / "configs" / "retrofit").glob("*.yaml"))
    assert len(shipped) >= 2
    for path in shipped:
        cfg = load_config(path)
        assert cfg.layouts and cfg.stage2 is not None, path
        if cfg.eval is not None:
            assert (repo / cfg.eval["config"]).is_file(), (path, cfg.eval)  # relative to the repository root
