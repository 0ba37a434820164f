"""The retrofit recipe end to end on a tiny random Llama with SmolLM2's tokenizer: stage 1 (every layer's transfer
error falls), the layouts (pattern and swap-KL selection), stage 2 with distillation in its own process, ``zoo eval``
with the layouts as contestants, the Hub-ready folders, and the resume (stage 1 and stage 2 read back, nothing rerun).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import transformers
import yaml

import zoo
from zoo.data import DataUnavailableError
from zoo.data.gutenberg import build_lm
from zoo.retrofit import recipe
from zoo.retrofit.config import load_config
from zoo.retrofit.report import stage2_curve

LAYERS = 4


@pytest.fixture(scope="module")
def tiny_folder(tiny_smollm2_llama):
    try:
        build_lm()
    except DataUnavailableError as exc:
        pytest.skip(f"corpus not available here: {exc}")
    return tiny_smollm2_llama(layers=LAYERS, max_positions=1024)


@pytest.fixture(scope="module")
def retrofit_run(tiny_folder, tmp_path_factory):
    work = tmp_path_factory.mktemp("retrofit")
    evaluation = work / "eval.yaml"
    evaluation.write_text(yaml.safe_dump({
        "model": str(tiny_folder), "output_dir": str(work / "unused"), "lengths": [256], "samples": 1, "threads": 1,
        "tasks": ["passkey"], "contestants": [{"family": "full"}],
        "perplexity": {"lengths": [256], "documents": 1, "bucket": 128, "chunk": 128, "contestants": ["full cache"]},
    }))  # fmt: skip
    config = work / "retrofit.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(tiny_folder), "output_dir": str(work / "out"), "variant": "gated_deltanet",
        "variant_params": {"short_conv": 4}, "threads": 1,
        "data": {"sequence_length": 64, "train_sequences": 6, "held_out_sequences": 2},
        "transfer": {"steps": 30, "learning_rate": 3.0e-3, "batch": 2, "lora": {"r": 4}},
        "layouts": [{"name": "every2", "every": 2}, {"name": "selected", "keep_full": 2, "by": "kl"}],
        "stage2": {"max_length": 64, "max_steps": 2, "max_eval_examples": 2, "per_device_train_batch_size": 2,
                   "per_device_eval_batch_size": 2, "distill_weight": 0.5, "trainable": "attention",
                   "logging_steps": 1, "disable_tqdm": True, "eval_strategy": "steps", "eval_steps": 1},
        "eval": {"config": str(evaluation)},
    }))  # fmt: skip
    return config, recipe.run(load_config(config))


def test_stage1_lowers_every_layers_error_and_measures_its_swap_kl(retrofit_run):
    config, summary = retrofit_run
    out = load_config(config).output_dir
    done = json.loads((out / "stage1" / "transfer_map.json").read_text())
    assert [row["layer"] for row in done["layers"]] == list(range(LAYERS))
    for row in done["layers"]:
        assert row["error_after"] < 0.8 * row["error_before"], row
        assert row["swap_kl"] > 0 and row["trained_parameters"] > 0 and row["tokens"] == 30 * 2 * 64
    assert done["train_tokens"] == 6 * 64 and done["held_out_tokens"] == 2 * 64
    assert done["activations_disk_bytes"] == 2 * LAYERS * 8 * 64 * 64 * 4
    for name in ("transfer_map.md", "transfer_map.png", "transferred.safetensors"):
        assert (out / "stage1" / name).is_file(), name
    assert (out / "stage2_curves.png").is_file() and "stage2_curves.png" in (out / "results.md").read_text()
    assert not list(out.glob("_activations*"))  # the captured activations are deleted


def test_layouts_follow_their_rule_and_reload_as_hybrids(retrofit_run):
    config, summary = retrofit_run
    out = load_config(config).output_dir
    layouts = {record["name"]: record for record in summary["layouts"]}
    assert layouts["every2"]["kept_full"] == [1, 3]
    kl = {row["layer"]: row["swap_kl"] for row in summary["stage1"]["layers"]}
    assert layouts["selected"]["kept_full"] == sorted(sorted(kl, key=kl.get)[-2:])
    for record in layouts.values():
        folder = out / record["model_folder"]
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        layers = zoo.variant_spec(model.config)["params"]["layers"]
        assert [i for i, layer in enumerate(layers) if layer["variant"] == "sdpa"] == record["kept_full"]
        assert all(layers[i]["variant"] == "gated_deltanet" for i in record["converted"])
        two = record["stage2"]
        assert two["tokens"] == 2 * 2 * 64 and two["held_out_kl"] >= 0 and two["seconds"] > 0
        assert [tokens for tokens, _ in stage2_curve(record, out)] == [128, 256]  # validation at each step
        own = json.loads((Path(folder) / "retrofit.json").read_text())
        assert own["layout"]["kept_full"] == record["kept_full"]
        card = (Path(folder) / "README.md").read_text()
        assert "base_model:" in card and "## Transfer map" in card and "retrofit" in card


def test_the_records_name_paths_relative_to_the_run_folder(retrofit_run):
    config, summary = retrofit_run
    out = load_config(config).output_dir
    assert summary["layouts"][0]["model_folder"] == f"{summary['layouts'][0]['name']}/stage2"
    assert summary["eval_folder"] == "eval" and summary["config"]["output_dir"] == "."
    records = [out / "retrofit.json", *out.glob("*/stage2.yaml"), *out.glob("*/stage2/retrofit.json"),
               *out.glob("*/stage2/README.md")]
    assert len(records) == 1 + 3 * len(summary["layouts"])
    for path in records:
        assert str(out) not in path.read_text(), path
    settings = yaml.safe_load(next(out.glob("*/stage2.yaml")).read_text())
    assert settings["output_dir"].endswith("/stage2") and settings["model_name_or_path"].endswith("/stage1")


def test_eval_scores_every_layout_beside_the_original(retrofit_run):
    _, summary = retrofit_run
    config, summary = retrofit_run
    out = load_config(config).output_dir
    headline = json.loads((out / summary["eval_folder"] / "results.json").read_text())
    names = {row["contestant"] for row in headline["headline"]}
    assert {"full cache", "retrofit every2", "retrofit selected"} <= names


def test_a_second_run_reads_every_stage_back(retrofit_run, monkeypatch):
    config, summary = retrofit_run
    calls = []
    monkeypatch.setattr(recipe, "train_layer", lambda *a, **k: pytest.fail("stage 1 ran again"))
    monkeypatch.setattr(subprocess, "run", lambda command, **k: calls.append(command))
    again = recipe.run(load_config(config), stages=("stage1", "stage2"))
    assert calls == []  # stage 2 read back (and eval left out)
    assert again["stage1"]["layers"] == summary["stage1"]["layers"]
    assert [r["kept_full"] for r in again["layouts"]] == [r["kept_full"] for r in summary["layouts"]]
