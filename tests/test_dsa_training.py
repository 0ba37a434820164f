"""DSA's indexer loss in the recipes (issue 41): the zoo's Trainer logs ``indexer_kl`` (the mean since the last log,
as the loss) with a DSA model and not without, beside ``distill_kl``; the compare report carries the curves; and a
retrofit's stage 1 of ``dsa`` is the dense warm-up, which lowers each layer's indexer KL and the sparse layer's
error, and saves sparse layers."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from test_retrofit import SMALL, _config, one_thread  # noqa: F401  (one thread, autouse)
from zoo.variants.dsa import DSAIndexer

import zoo
from zoo.plug.install import configure
from zoo.plug.weights import WEIGHTS_NAME, attention_modules
from zoo.retrofit.capture import capture
from zoo.retrofit.config import RetrofitConfig, RetrofitConfigError, load_config
from zoo.retrofit.recipe import own_stage
from zoo.retrofit.report import transfer_table
from zoo.retrofit.selection import apply_layout, attention_states, hybrid_layers
from zoo.retrofit.transfer import TransferSettings, held_out_error, train_layer
from zoo.training.compare_plan import Outcome, Run
from zoo.training.compare_report import curve_lines, row_for, summarize
from zoo.training.distill import DistillingTrainer, token_kl
from zoo.training.trainer import Trainer

DSA = {"index_heads": 2, "index_dim": 8, "top_k": 6}


def tiny_llama(variant: str = "dsa", **params):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64)  # fmt: skip
    zoo.configure(config, variant, **params)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def examples(count: int = 2, length: int = 20) -> list[dict]:
    ids = torch.randint(3, 64, (count, length), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


def direct_kl(model, example: dict) -> float:
    """The sum over the layers of each indexer's KL in a training forward on one example (read layer by layer)."""
    ids = torch.tensor([example["input_ids"]])
    model.train()
    model(input_ids=ids, labels=ids)
    layers = [m.last_loss for m in model.modules() if isinstance(m, DSAIndexer)]
    assert len(layers) == 2 and all(loss is not None for loss in layers)
    return sum(float(loss) for loss in layers)


def arguments(tmp_path, **changes) -> transformers.TrainingArguments:
    options = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=1,
                   gradient_accumulation_steps=2, max_steps=2, logging_steps=2, learning_rate=0.0,
                   save_strategy="no", disable_tqdm=True)  # fmt: skip
    return transformers.TrainingArguments(**{**options, **changes})


def logged(trainer, name: str) -> list[float]:
    return [record[name] for record in trainer.state.log_history if name in record]


# ---------------------------------------------------------------------------------------------------
# the Trainer's log


def test_trainer_logs_the_mean_indexer_kl_of_the_layers_since_the_last_log(tmp_path):
    model, data = tiny_llama(**DSA), examples()
    # learning rate 0: the weights stay put, so each micro-batch's KL is the one computed here
    expected = sum(direct_kl(copy.deepcopy(model), example) for example in data) / len(data)
    trainer = Trainer(model=model, args=arguments(tmp_path), train_dataset=data)
    trainer.train()
    # 2 steps x 2 micro-batches of one example, logged once: the mean of the 4 (not their sum)
    assert logged(trainer, "indexer_kl") == [pytest.approx(expected, rel=1e-5)]
    assert len(logged(trainer, "loss")) == 1 and expected > 0
    assert trainer.logged_curves() == {"indexer_kl": [[2, pytest.approx(expected, rel=1e-5)]]}


def test_trainer_logs_no_indexer_kl_without_dsa_layers(tmp_path):
    trainer = Trainer(model=tiny_llama("sdpa"), args=arguments(tmp_path), train_dataset=examples())
    trainer.train()
    assert len(logged(trainer, "loss")) == 1
    assert not [record for record in trainer.state.log_history if "indexer_kl" in record]
    assert trainer.logged_curves() == {}


def test_distilling_trainer_logs_distill_kl_beside_the_indexer_kl(tmp_path):
    student, data = tiny_llama(**DSA), examples(1)
    teacher = copy.deepcopy(student).eval()
    with torch.no_grad():
        for parameter in teacher.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    ids = torch.tensor([data[0]["input_ids"]])
    with torch.no_grad():
        kl, tokens = token_kl(student.train()(input_ids=ids).logits, teacher(input_ids=ids).logits, ids, 1.0)
    indexer = direct_kl(copy.deepcopy(student), data[0])
    args = arguments(tmp_path, gradient_accumulation_steps=1, max_steps=1, logging_steps=1)
    trainer = DistillingTrainer(model=student, args=args, train_dataset=data, teacher=teacher, weight=0.5,
                                temperature=1.0)  # fmt: skip
    trainer.train()
    assert logged(trainer, "distill_kl") == [pytest.approx(float(kl / tokens), rel=1e-5)]
    assert logged(trainer, "indexer_kl") == [pytest.approx(indexer, rel=1e-5)]
    assert sorted(trainer.logged_curves()) == ["distill_kl", "indexer_kl"]


def test_compare_report_averages_the_logged_curves_over_seeds(tmp_path):
    curves = [{"indexer_kl": [[2, 1.0], [4, 0.5]]}, {"indexer_kl": [[2, 3.0], [4, 1.5]]}]
    rows = []
    for seed, curve in enumerate(curves):
        run = Run(task="t", name="dsa", seed=seed, config={"variant": "dsa"}, run_dir=tmp_path / f"s{seed}")
        rows.append(row_for(run, Outcome("ok", results={"metrics": {}, "training_curves": curve})))
    assert rows[1]["training_curves"] == curves[1]
    (entry,) = summarize(rows)
    assert entry["training_curves"] == {"indexer_kl": [(2, 2.0), (4, 1.0)]}
    assert "- **dsa**: indexer_kl 2 (step 2) -> 1 (step 4)" in curve_lines([entry])
    assert curve_lines([{**entry, "training_curves": {}}]) == []


# ---------------------------------------------------------------------------------------------------
# the retrofit's stage 1: the dense warm-up


ROWS = list(range(8))  # trained and measured on the same rows: 8 sequences are too few to generalize from


def sharp_llama():
    """The tiny Llama of tests/test_retrofit.py, its q/k scaled so attention is peaked (a sparse layer's error then
    depends on which keys it reads), frozen, under the zoo's sdpa."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(16.0)
            layer.self_attn.k_proj.weight.mul_(16.0)
    configure(model, "sdpa")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """Stage 1 of ``dsa`` on every layer of the sharp tiny Llama, as recipe.stage1 runs it."""
    folder = tmp_path_factory.mktemp("dsa_stage1")
    cfg = RetrofitConfig(model="tiny", output_dir=folder, variant="dsa", variant_params={**DSA, "top_k": 8},
                         transfer=TransferSettings(steps=60, learning_rate=1e-2, batch=2))  # fmt: skip
    model = sharp_llama()
    sequences = torch.randint(0, SMALL["vocab_size"], (8, 48), generator=torch.Generator().manual_seed(1))
    captured = capture(model, sequences, folder / "acts")
    original = attention_states(model)
    layers = sorted(original)
    configure(model, "hybrid", layers=hybrid_layers(len(original), layers, cfg.entry))
    modules = {idx: module for _, idx, module in attention_modules(model)}
    stage = own_stage(cfg, model, len(original), layers)
    rows, transferred = {}, {}
    for layer in layers:
        modules[layer].load_state_dict(original[layer], strict=False)
        rows[layer] = train_layer(modules[layer], captured, layer, ROWS, ROWS, cfg.transfer, stage)
        transferred[layer] = {k: v.detach().clone() for k, v in modules[layer].state_dict().items()}
    return {"cfg": cfg, "model": model, "captured": captured, "rows": rows, "transferred": transferred,
            "original": original, "sequences": sequences}  # fmt: skip


def test_dsa_transfer_stage_is_the_dense_warmup(tmp_path):
    cfg = load_config(_config(tmp_path, variant="dsa", variant_params={"top_k": 8}, transfer={"steps": 5}))
    assert cfg.stage.params == {"dense_warmup": True, "indexer_loss_weight": 1.0} and cfg.stage.measure == "indexer_kl"
    assert cfg.stage_entry == {"variant": "dsa", "params": {"top_k": 8, "dense_warmup": True,
                                                            "indexer_loss_weight": 1.0}}  # fmt: skip
    assert cfg.entry == {"variant": "dsa", "params": {"top_k": 8}}
    assert load_config(_config(tmp_path)).stage is None  # gated_deltanet: the plain transfer
    with pytest.raises(RetrofitConfigError, match="transfer.lora.*indexer_kl"):
        load_config(_config(tmp_path, variant="dsa", variant_params={}))  # _config asks for LoRA
    with pytest.raises(RetrofitConfigError, match="drop dense_warmup"):
        load_config(_config(tmp_path, variant="dsa", variant_params={"dense_warmup": True}, transfer={"steps": 5}))


def test_dsa_stage1_lowers_every_layers_indexer_kl_and_sparse_error(warmed):
    for layer, row in warmed["rows"].items():
        assert row["measure"] == "indexer_kl" and row["steps"] == 60, row
        assert row["measure_after"] < 0.85 * row["measure_before"], row
        assert math.isfinite(row["error_before"]) and row["error_after"] < 0.8 * row["error_before"], row
        variant_keys = [k for k in warmed["transferred"][layer] if k.startswith(f"{WEIGHTS_NAME}.")]
        assert row["trained_parameters"] == sum(warmed["transferred"][layer][k].numel() for k in variant_keys)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # only the indexer trained
            torch.testing.assert_close(warmed["transferred"][layer][f"{name}.weight"],
                                       warmed["original"][layer][f"{name}.weight"], rtol=0, atol=0)  # fmt: skip
    # the model is left sparse, and the reported error is the sparse layer's (the warm-up's would be ~0)
    model, captured = warmed["model"], warmed["captured"]
    part = zoo.variant_for(model.config).part(0)
    assert part.name == "dsa" and not part.dense_warmup
    module = dict((idx, m) for _, idx, m in attention_modules(model))[1]
    assert held_out_error(module, captured, 1, ROWS) == pytest.approx(warmed["rows"][1]["error_after"], rel=1e-5)
    table = transfer_table({"layers": [{**row, "swap_kl": 0.0} for row in warmed["rows"].values()]})
    assert "| indexer_kl before | indexer_kl after |" in table


def test_dsa_layout_saves_sparse_layers(warmed, tmp_path):
    model, cfg = warmed["model"], warmed["cfg"]
    ids = warmed["sequences"][6:]
    apply_layout(model, [0, 1], cfg.entry, warmed["transferred"], warmed["original"])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for layer in range(2):
        part = zoo.variant_for(reloaded.config).part(layer)
        assert part.name == "dsa" and part.dense_warmup is False and part.top_k == 8
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, use_cache=False).logits, logits, rtol=0, atol=1e-5)
