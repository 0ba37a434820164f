"""``zoo eval`` end to end on a tiny random Llama with SmolLM2's tokenizer: the config machinery, every contestant
family, shared prefills equal to own prefills, resume, perplexity against one full forward, speed in its own
process, the report; and the config's refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from transformers import AutoTokenizer

from zoo.eval.cli import main
from zoo.eval.config import EvalConfigError, expand_contestants, load_config
from zoo.eval.contestants import configure_for
from zoo.eval.perplexity import documents, token_losses
from zoo.eval.report import overall, zoo_against_kvpress
from zoo.eval.rows import with_fields
from zoo.eval.scoring import summarize
from zoo.plug.spec import variant_for
from zoo.reporting import read_jsonl
from zoo.testing import tiny_model_config


@pytest.fixture(scope="module")
def tiny_folder(tiny_smollm2_llama):
    return tiny_smollm2_llama(layers=2, max_positions=4096)


def write_config(path, folder, out, **changes):
    config = {
        "model": str(folder), "output_dir": str(out), "lengths": [256], "samples": 2, "threads": 1,
        "tasks": ["niah_single", "passkey"],
        "contestants": [
            {"family": "full"},
            {"family": "budget", "policies": ["tova", "snapkv"], "budgets": [0.5]},
            {"family": "budget", "policy": "knorm", "tokens": [4096], "name": "budget knorm everything"},
            {"family": "window", "budgets": [0.5]},
            {"family": "quantized", "nbits": 4},
            {"family": "variant", "variant": "longformer", "params": {"window": 4096}},
            {"family": "folder", "path": str(folder)},
        ],
        "perplexity": {"lengths": [512], "documents": 1, "bucket": 256, "chunk": 128,
                       "contestants": ["full cache", "budget tova 50%"]},
        "speed": {"lengths": [256], "new_tokens": 3, "rounds": 1, "contestants": ["full cache"]},
        **changes,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_tiny_run_measures_every_family_resumes_and_reports(tiny_folder, tmp_path):
    out = tmp_path / "run"
    config = write_config(tmp_path / "eval.yaml", tiny_folder, out)
    assert main([str(config)]) == 0
    rows = read_jsonl(out / "answers.jsonl")
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    names = {r["contestant"] for r in rows}
    assert len(rows) == 2 * 8 and len(names) == 8
    by = {(r["contestant"], r["task"]): r for r in rows}
    for task in ("niah_single", "passkey"):
        full = by[("full cache", task)]
        # keeping every key (a bound above the context), a full-window variant and the saved folder itself: the
        # same greedy answers as the full cache, whether from the shared prefill or from their own
        for same in ("budget knorm everything", "longformer(window=4096)", f"folder {tiny_folder.name}"):
            assert by[(same, task)]["outputs"] == full["outputs"], same
        assert by[("budget tova 50%", task)]["cache_bytes"] < full["cache_bytes"]
        assert by[("window + 4 sinks 50%", task)]["cache_bytes"] < full["cache_bytes"]
        assert 0 <= full["low"] <= full["score"] <= full["high"] <= 1 and full["n"] == 2
    ppl = read_jsonl(out / "perplexity.jsonl")
    assert {r["contestant"] for r in ppl} == {"full cache", "budget tova 50%"} and not any("error" in r for r in ppl)
    speed = read_jsonl(out / "speed.jsonl")
    assert len(speed) == 1 and speed[0]["ms_per_token"] > 0 and speed[0]["peak_rss_bytes"] > 0, speed
    report = (out / "results.md").read_text()
    assert "full cache" in report and "Perplexity by position" in report
    for name in ("results.csv", "results.json", "score_by_length.png", "score_vs_cache_bytes.png",
                 "niah_single_depths.png"):
        assert (out / name).stat().st_size > 0

    sizes = {name: (out / name).stat().st_size for name in ("answers.jsonl", "perplexity.jsonl", "speed.jsonl")}
    assert main([str(config), "--stages", "answers", "perplexity", "speed"]) == 0  # resumed: nothing to do
    assert sizes == {name: (out / name).stat().st_size for name in sizes}

    changed = write_config(tmp_path / "other.yaml", tiny_folder, out, samples=3)  # the depths of samples 0, 1 move
    with pytest.raises(SystemExit, match="other prompts"):
        main([str(changed)])

    fewer = write_config(tmp_path / "fewer.yaml", tiny_folder, out, tasks=["passkey"])  # a task dropped
    assert main([str(fewer), "--stages", "answers", "report"]) == 0
    assert sizes["answers.jsonl"] == (out / "answers.jsonl").stat().st_size  # its answers kept, nothing new to run
    assert "niah_single" not in (out / "results.md").read_text().split("## Perplexity")[0]


def test_perplexity_through_a_chunked_cache_equals_one_forward(tiny_folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    ids = torch.tensor([documents(tokenizer, 300, 1)[0]])
    losses, _ = token_losses(model, {"family": "full", "name": "full cache"}, ids, chunk=64)
    with torch.no_grad():
        logits = model(ids).logits
    whole = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
    assert losses.shape == whole.shape
    torch.testing.assert_close(losses, whole, atol=1e-4, rtol=1e-4)


def test_documents_are_disjoint_stretches_of_the_held_out_books(tiny_folder):
    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    picked = documents(tokenizer, 1000, 4)
    assert len(picked) == 4 and all(len(d) == 1000 for d in picked)
    assert len({tuple(d[:50]) for d in picked}) == 4
    with pytest.raises(ValueError, match="too few"):
        documents(tokenizer, 10**6, 2)


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_folder, tmp_path, capsys):
    out = tmp_path / "run"
    main([str(write_config(tmp_path / "eval.yaml", tiny_folder, out)), "--dry_run"])
    printed = capsys.readouterr().out
    assert "niah_single @ 256: 2 samples" in printed and "budget snapkv 50%" in printed
    assert not (out / "answers.jsonl").exists()


def test_every_shipped_eval_config_loads():
    paths = sorted(Path("recipes/configs/eval").glob("*.yaml"))
    assert len(paths) >= 3
    for path in paths:
        config = load_config(str(path))
        assert config.contestants[0]["name"] == "full cache"
        assert len({c["name"] for c in config.contestants}) == len(config.contestants)


@pytest.mark.parametrize(("entries", "message"), [
    ([{"family": "budgets"}], "needs a family"),
    ([{"family": "budget", "policy": "tova", "budgets": [0.5], "tokens": [64]}], "exactly one of budgets"),
    ([{"family": "window"}], "exactly one of budgets"),
    ([{"family": "budget", "budgets": [1.5]}], "not a fraction"),
    ([{"family": "full"}, {"family": "full"}], "more than once"),
    ([{"family": "variant"}], "variant: NAME"),
    ([{"family": "folder"}], "path: FOLDER"),
])
def test_bad_contestants_are_refused_with_the_fix(entries, message):
    with pytest.raises(EvalConfigError, match=message):
        expand_contestants(entries)


def test_bad_configs_are_refused_with_the_fix(tmp_path):
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump({"model": "m", "output_dir": "o", "tasks": ["nope"], "contestants": []}))
    with pytest.raises(EvalConfigError, match="unknown task 'nope'"):
        load_config(path)
    path.write_text(yaml.safe_dump({"model": "m", "output_dir": "o", "tasks": [], "contestants": [], "lenghts": 1}))
    with pytest.raises(EvalConfigError, match="unknown keys"):
        load_config(path)


def _row(name, family, kept, task, scores):
    mean = sum(scores) / len(scores)
    return with_fields({"contestant": name, "family": family, "kept": kept, "task": task, "length": 1024,
                        "scores": scores, **summarize(scores), "score": mean, "budget": kept})


def test_the_zoo_against_kvpress_verdict_reads_the_intervals():
    answers = [_row("budget snapkv 25%", "budget", 0.25, t, [1.0] * 20) for t in ("a", "b")]
    answers += [_row("kvpress KNorm 25%", "kvpress", 0.25, "a", [0.0] * 20),
                _row("kvpress KNorm 25%", "kvpress", 0.25, "b", [1.0] * 20)]
    assert math.isclose(overall(answers, [1024])["kvpress KNorm 25%"]["score"], 0.5)
    (line,) = zoo_against_kvpress(answers, [1024])
    assert "zoo ahead" in line and "a @ 1024" in line and "b @ 1024" not in line
    close = [_row("budget snapkv 25%", "budget", 0.25, "a", [1.0, 0.0] * 3),
             _row("kvpress KNorm 25%", "kvpress", 0.25, "a", [1.0, 1.0, 0.0] * 2)]
    assert "tie" in zoo_against_kvpress(close, [1024])[0]
    assert json.dumps(answers)  # rows stay JSON


def test_budget_contestants_keep_the_variants_default_slack():
    """The eval measures ``budget`` as users get it (slack tokens // 16), not the KV benchmark's slack 0."""
    model = transformers.AutoModelForCausalLM.from_config(tiny_model_config("llama", "sdpa"))
    contestant = expand_contestants([{"family": "budget", "policies": ["snapkv"], "budgets": [0.25]}])[0]
    configure_for(model, contestant, 1024)
    assert variant_for(model.config).slack is None and contestant["tokens_kept"] == 256
    configure_for(model, {**contestant, "slack": 0}, 1024)
    assert variant_for(model.config).slack == 0
