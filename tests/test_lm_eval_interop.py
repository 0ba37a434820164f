"""lm-evaluation-harness runs a zoo model as any Hugging Face model: a saved longformer folder through
``python -m zoo.interop.lm_eval`` (the documented command) on a local JSON task, offline, gives the same per-sample
log-likelihoods and generations as ``HFLM(pretrained=model)`` on the configured model in memory, and not those of the
same weights under SDPA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import zoo
from zoo.data.pretrained import smollm2_folder

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven red birds sing near the quiet old river bank".split()
TASKS = ["zoo_tiny_mc", "zoo_tiny_gen"]
TASK_YAML = """\
task: zoo_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
metadata:
  version: 1.0
---
task: zoo_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}\\nAnswer:"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random Llama configured as longformer (window 16 < every context) and saved; a 5-row local task."""
    root = tmp_path_factory.mktemp("lm_eval")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    zoo.configure(model, "longformer", window=16, global_tokens=[0])
    folder = root / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = root / "data.jsonl"
    rows = [{"context": " ".join((WORDS[i:] + WORDS[:i]) * 2), "choices": [WORDS[i], WORDS[i + 1], "yes"],
             "label": i % 3} for i in range(5)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "zoo_tiny_mc.yaml").write_text(TASK_YAML.split("---\n")[0].format(data=data))
    (tasks / "zoo_tiny_gen.yaml").write_text(TASK_YAML.split("---\n")[1].format(data=data))
    return model, tokenizer, folder, tasks, root


def in_process(model, tokenizer, tasks):
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu")
    return lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=TaskManager(include_path=str(tasks)),
                                   log_samples=True)


def outputs(samples):
    """Per task, per document: the filtered responses (log-likelihoods or generated text)."""
    return {task: [s["filtered_resps"] for s in sorted(rows, key=lambda s: s["doc_id"])]
            for task, rows in samples.items()}


def test_saved_zoo_model_runs_in_lm_eval_cli(setup):
    model, tokenizer, folder, tasks, root = setup
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert reloaded.config._attn_implementation == zoo.IMPLEMENTATION
    assert zoo.variant_for(reloaded.config).name == "longformer"

    out = root / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "zoo.interop.lm_eval", "--model", "hf",
         "--model_args", f"pretrained={folder},dtype=float32", "--device", "cpu", "--batch_size", "1",
         "--tasks", ",".join(TASKS), "--include_path", str(tasks), "--output_path", str(out), "--log_samples"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    [results_file] = Path(out).rglob("results_*.json")
    cli = json.loads(results_file.read_text())
    cli_samples = {task: [json.loads(line) for line in next(Path(out).rglob(f"samples_{task}_*.jsonl")).open()]
                   for task in TASKS}

    ours = in_process(model, tokenizer, tasks)
    for task, metric in [("zoo_tiny_mc", "acc,none"), ("zoo_tiny_gen", "exact_match,none")]:
        assert cli["results"][task][metric] == ours["results"][task][metric]
    cli_out, our_out = outputs(cli_samples), outputs(ours["samples"])
    assert cli_out["zoo_tiny_gen"] == our_out["zoo_tiny_gen"]
    flat = lambda out: torch.tensor([float(ll) for doc in out["zoo_tiny_mc"] for ll, _ in doc])  # noqa: E731
    torch.testing.assert_close(flat(cli_out), flat(our_out), rtol=1e-4, atol=1e-4)

    # the same weights under SDPA score differently: lm-eval ran the zoo's windowed attention, not the model's own
    sdpa = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    assert not torch.allclose(flat(outputs(in_process(sdpa, tokenizer, tasks)["samples"])), flat(our_out), atol=1e-3)
