"""Causal language modelling: book-level splits, chunking, the BPE tokenizer, loss by position against a direct
computation, the LM recipe end to end (Hub-ready folder, reload in a fresh process, card, push dry run), DDP and
FSDP over 2 gloo processes, launches that cannot run here, and the LM comparison."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

import zoo
from zoo.data import DataUnavailableError, build_task, cache_dir
from zoo.data.lm import bpe_tokenizer, chunk_documents
from zoo.training import compare, distributed, lm
from zoo.training import finetune as train
from zoo.training.config import FinetuneConfig

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = REPO / "recipes" / "accelerate"
SMOKE_LM = REPO / "recipes" / "configs" / "smoke_lm.yaml"
LLAMA = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 64}  # fmt: skip
# 8 training steps on the first 3,000 words of each book; 256-token chunks (buckets [0,128) and [128,256)).
TINY_LM = {
    "task": "gutenberg_lm",
    "task_options": {"max_words_per_book": 3000},
    "tokenizer_vocab_size": 512,
    "model_config": LLAMA,
    "max_length": 256,
    "max_eval_examples": 6,
    "variant": "longformer",
    "variant_params": {"window": 64},
    "learning_rate": 3.0e-3,
    "max_steps": 8,
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 4,
    "save_strategy": "no",
    "logging_steps": 4,
    "disable_tqdm": True,
    "generate_new_tokens": 8,
    "seed": 3,
}
FAST_SMOKE = ["--task_options", "{max_words_per_book: 3000}", "--tokenizer_vocab_size", "512", "--max_steps", "4",
              "--max_eval_examples", "4", "--generate_new_tokens", "4", "--disable_tqdm", "true"]  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("lm")


@pytest.fixture(scope="module")
def env(workdir):
    """A private zoo cache that shares the fetched corpora (npm tarballs) of the user's cache; no Hub; 1 thread."""
    try:
        build_task("gutenberg_lm", max_words_per_book=10)
        build_task("brown_lm")
    except DataUnavailableError as exc:
        pytest.skip(f"corpus not available here: {exc}")
    private = workdir / "cache"
    private.mkdir()
    (private / "npm").symlink_to(cache_dir() / "npm")
    return {**os.environ, "ATTENTION_ZOO_CACHE": str(private), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def private_cache(env, monkeypatch):
    monkeypatch.setenv("ATTENTION_ZOO_CACHE", env["ATTENTION_ZOO_CACHE"])


def run_recipe(config, env, *overrides, launcher=None, num_processes=None):
    prefix = [sys.executable, "-m", "zoo.training.finetune"]
    if launcher:
        prefix = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launcher)]
        if num_processes:
            prefix += ["--num_processes", str(num_processes), "--mixed_precision", "no"]
        prefix += ["-m", "zoo.training.finetune"]
    done = subprocess.run([*prefix, str(config), *map(str, overrides)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def results(output_dir):
    return json.loads((Path(output_dir) / "results.json").read_text())


# --- data ------------------------------------------------------------------------------------------


def test_gutenberg_lm_holds_out_whole_books(private_cache):
    dataset = build_task("gutenberg_lm", max_words_per_book=50)
    books = {split: set(rows["document"]) for split, rows in dataset.items()}
    assert books["test"] == {"austen-persuasion", "chesterton-thursday"} and books["validation"] == {"carroll-alice"}
    assert not (books["train"] & books["test"]) and not (books["train"] & books["validation"])
    assert len(books["train"]) == 15 and "austen-emma" in books["train"]
    assert all(len(text.split(" ")) <= 50 for text in dataset["train"]["text"])
    with pytest.raises(ValueError, match="unknown: \\['no-such-book'\\].*Books: austen-emma"):
        build_task("gutenberg_lm", test_books=["no-such-book"])
    with pytest.raises(ValueError, match="both validation_books and test_books"):
        build_task("gutenberg_lm", validation_books=["carroll-alice"], test_books=["carroll-alice"])


def test_brown_lm_splits_by_document(private_cache):
    dataset = build_task("brown_lm")
    ids = [set(rows["document"]) for rows in dataset.values()]
    assert sum(map(len, ids)) == len(set.union(*ids)) == 500
    assert dataset["train"].column_names == ["document", "genre", "text"]


@pytest.fixture(scope="module")
def small_tokenizer(workdir):
    texts = [f"the {w} sat on the mat and the {w} ran to the park. " * 20 for w in ("cat", "dog", "fox")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATTENTION_ZOO_CACHE", str(workdir / "unit-cache"))
        return bpe_tokenizer(texts, 600), texts


def test_chunks_never_span_two_documents(small_tokenizer):
    tokenizer, _ = small_tokenizer
    lengths = {"a": 300, "b": 70, "c": 130}
    documents = {name: " ".join(f"{name}{i}" for i in range(n)) for name, n in lengths.items()}
    split = datasets.Dataset.from_dict({"text": list(documents.values()), "document": list(documents)})
    dataset = datasets.DatasetDict({"train": split, "test": split})
    full = chunk_documents(dataset, tokenizer, max_length=64)["train"]
    padded = chunk_documents(dataset, tokenizer, max_length=64, min_chunk_length=20)["train"]
    ids = {name: tokenizer(text)["input_ids"] for name, text in documents.items()}
    for rows, shortest in ((full, 64), (padded, 20)):
        for row in rows:
            own = ids[row["document"]]
            assert row["input_ids"] == own[row["start"] : row["start"] + 64]  # one document's consecutive tokens
            assert shortest <= len(row["input_ids"]) <= 64
        for name, own in ids.items():  # every kept chunk, none missing
            starts = [r["start"] for r in rows if r["document"] == name]
            assert starts == [s for s in range(0, len(own), 64) if len(own) - s >= shortest]
    assert all(len(r) == 64 for r in full["input_ids"])  # packed: a batch of them needs no padding
    with pytest.raises(ValueError, match="yields no chunk; lower max_length or set min_chunk_length"):
        chunk_documents(dataset, tokenizer, max_length=4096)


def test_bpe_tokenizer_is_cached_by_training_text(small_tokenizer, workdir, monkeypatch):
    tokenizer, texts = small_tokenizer
    monkeypatch.setenv("ATTENTION_ZOO_CACHE", str(workdir / "unit-cache"))
    assert 256 < len(tokenizer) <= 600 and tokenizer.pad_token == "<|pad|>" and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.decode(tokenizer("the fox ran")["input_ids"]) == "the fox ran"  # byte-level: lossless
    assert len(tokenizer("the cat sat on the mat")["input_ids"]) < 10  # merges learned from the training text
    def retrain(*args):
        raise RuntimeError("retrained")

    monkeypatch.setattr("zoo.data.lm.train_bpe", retrain)
    assert bpe_tokenizer(texts, 600).get_vocab() == tokenizer.get_vocab()  # loaded from the cache
    for other in ((texts[:2], 600), (texts, 700)):  # other training text or size: another tokenizer
        with pytest.raises(RuntimeError, match="retrained"):
            bpe_tokenizer(*other)


# --- metrics ---------------------------------------------------------------------------------------


def test_position_buckets_cover_the_window():
    assert lm.position_buckets(256) == [(0, 128), (128, 256)]
    assert lm.position_buckets(4096) == [(0, 128), (128, 512), (512, 2048), (2048, 4096)]
    assert lm.position_buckets(10000)[-2:] == [(4096, 8192), (8192, 10000)]
    assert [lm.bucket_name(*b) for b in lm.position_buckets(4096)] == ["[0,128)", "[128,512)", "[512,2K)", "[2K,4K)"]


def test_loss_by_position_matches_a_direct_computation():
    config = zoo.configure(transformers.AutoConfig.for_model(**LLAMA, vocab_size=97), "sdpa")
    transformers.set_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 97, (3, 200))
    labels = ids.clone()
    labels[2, 150:] = -100  # a padded tail: ignored
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        model_loss = model(input_ids=ids, labels=labels).loss
    metric = lm.PositionLoss(max_length=200)
    metrics = metric(transformers.EvalPrediction(predictions=lm.per_token_loss(logits, labels).numpy(),
                                                 label_ids=labels.numpy()))  # fmt: skip
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    direct = {(b, p): -log_probs[b, p - 1, ids[b, p]].item() for b in range(3) for p in range(1, 200)
              if labels[b, p] != -100}  # fmt: skip
    mean = sum(direct.values()) / len(direct)
    assert metrics["token_loss"] == pytest.approx(mean, rel=1e-5)
    assert metrics["token_loss"] == pytest.approx(model_loss.item(), rel=1e-5)  # the model's own mean token loss
    assert metrics["perplexity"] == pytest.approx(math.exp(mean), rel=1e-5)
    for bucket in metric.by_position:
        inside = [v for (b, p), v in direct.items() if bucket["start"] <= p < bucket["end"]]
        assert bucket["tokens"] == len(inside)
        assert bucket["loss"] == pytest.approx(sum(inside) / len(inside), rel=1e-5)
    assert [b["tokens"] for b in metric.by_position] == [3 * 127, 2 * 72 + 22]


# --- errors before training ------------------------------------------------------------------------


def lm_config(tmp_path, **overrides):
    return FinetuneConfig(**{**TINY_LM, "output_dir": str(tmp_path / "out"), **overrides})


def test_bidirectional_only_variant_is_refused_before_any_data(tmp_path, monkeypatch):
    @zoo.register_variant
    class BidirectionalOnly(zoo.Variant):
        name = "test_lm_bidirectional_only"
        supports_causal = False

    monkeypatch.setattr(train.tasks, "build_task", lambda *a, **k: pytest.fail("data loaded before the check"))
    try:
        with pytest.raises(ValueError, match="trains a causal language model.*does not support causal"):
            train.run(lm_config(tmp_path, variant="test_lm_bidirectional_only", variant_params={}))
    finally:
        zoo.unregister_variant("test_lm_bidirectional_only")
    with pytest.raises(ValueError, match="model_type 'bert' is not a causal decoder"):
        train.run(lm_config(tmp_path, model_config={"model_type": "bert"}))
    with pytest.raises(ValueError, match="generate_prompt_tokens=250 must lie in"):
        train.run(lm_config(tmp_path, generate_prompt_tokens=250))


def test_deepspeed_without_a_gpu_is_refused_before_training(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(train.tasks, "build_task", lambda *a, **k: pytest.fail("data loaded before the check"))
    with pytest.raises(RuntimeError, match="DeepSpeed.*(not installed|needs a CUDA GPU).*fsdp.yaml"):
        train.run(lm_config(tmp_path))
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(RuntimeError, match="FSDP version 1, which does not run on CPU.*fsdp_version: 2"):
        distributed.check_launch(accelerator_available=False)


# --- the recipe end to end -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_run(workdir, env):
    config = workdir / "tiny_lm.yaml"
    config.write_text(yaml.safe_dump({**TINY_LM, "output_dir": str(workdir / "lm")}))
    run_recipe(config, env)
    return workdir / "lm"


def test_lm_recipe_writes_a_hub_ready_folder(lm_run):
    names = {p.name for p in lm_run.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "results.json", "sample.json", "sample.txt",
            "README.md", "train_log.jsonl"} <= names  # fmt: skip
    record = results(lm_run)
    assert record["architecture"] == "LlamaForCausalLM" and record["variant"] == "longformer"
    assert record["distributed_type"] == "single" and record["num_processes"] == record["world_size"] == 1
    assert record["parameters"]["per_rank"] == [record["parameters"]["total"]]
    metrics = record["metrics"]
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert metrics["eval_loss"] < math.log(512)  # better than uniform over the vocabulary after 8 steps
    assert [b["bucket"] for b in record["loss_by_position"]] == ["[0,128)", "[128,256)"]
    assert [b["tokens"] for b in record["loss_by_position"]] == [6 * 127, 6 * 128]
    assert record["decode_tokens_per_second"] > 0 and record["generation"]["new_tokens"] == 8
    assert record["generation"]["prompt_tokens"] == 256 - 8
    config = json.loads((lm_run / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["vocab_size"] == 512 and config["use_cache"] is True
    assert "rope" in json.dumps(config)  # rotary positions (Llama)
    tokenizer = transformers.AutoTokenizer.from_pretrained(lm_run)
    assert len(tokenizer) == 512 and tokenizer.pad_token_id == config["pad_token_id"]


def test_fresh_process_generates_the_saved_sample(lm_run, env):
    script = f"""
import json, torch, transformers, zoo
sample = json.load(open({str(lm_run / "sample.json")!r}))
model = transformers.AutoModelForCausalLM.from_pretrained({str(lm_run)!r})
assert zoo.variant_spec(model.config)["variant"] == "longformer"
prompt = torch.tensor([sample["prompt_ids"]])
out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(sample["continuation_ids"]),
                     min_new_tokens=len(sample["continuation_ids"]), do_sample=False)
assert out[0, prompt.shape[1]:].tolist() == sample["continuation_ids"], (out[0, prompt.shape[1]:].tolist(), sample)
print("SAME TOKENS")
"""
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SAME TOKENS" in done.stdout


def test_lm_card_and_push_dry_run(lm_run, capsys):
    from huggingface_hub import ModelCard

    card = ModelCard.load(lm_run / "README.md")
    assert card.data.pipeline_tag == "text-generation"
    metrics = {m["type"]: m["value"] for m in card.data.to_dict()["model-index"][0]["results"][0]["metrics"]}
    assert metrics["perplexity"] == pytest.approx(results(lm_run)["metrics"]["eval_perplexity"], rel=1e-3)
    sample = json.loads((lm_run / "sample.json").read_text())
    assert sample["continuation"] in card.text and "## Loss by token position" in card.text
    assert "AutoModelForCausalLM.from_pretrained" in card.text and "model.generate" in card.text
    from zoo.cli import main as zoo_main

    assert zoo_main(["push", str(lm_run), "--repo-id", "someone/tiny-lm", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "sample.json" in printed and "model.safetensors" in printed and "pipeline_tag: text-generation" in printed


@pytest.mark.slow
def test_two_processes_fine_tune_a_pretrained_decoder(lm_run, workdir, env):
    """DDP over gloo, from the saved model (a pretrained decoder and its tokenizer), on the Brown documents."""
    out = workdir / "ddp"
    run_recipe(SMOKE_LM, env, *FAST_SMOKE, "--task", "brown_lm", "--task_options", "{}", "--model_config", "{}",
               "--model_name_or_path", lm_run, "--max_length", "256", "--output_dir", out,
               launcher=ACCELERATE / "multi_cpu.yaml")  # fmt: skip
    record = results(out)
    assert record["num_processes"] == 2 and record["distributed_type"] == "DDP"
    assert record["parameters"]["per_rank"] == [record["parameters"]["total"]] * 2  # replicated
    assert record["base_model"] == str(lm_run) and record["task"] == "brown_lm"
    assert (out / "tokenizer.json").read_text() == (lm_run / "tokenizer.json").read_text()


@pytest.mark.slow
def test_fsdp_config_shards_the_parameters_on_two_cpu_processes(workdir, env):
    out = workdir / "fsdp"
    run_recipe(SMOKE_LM, env, *FAST_SMOKE, "--output_dir", out, launcher=ACCELERATE / "fsdp.yaml", num_processes=2)
    record = results(out)
    assert record["distributed_type"] == "FSDP" and record["world_size"] == 2
    total, per_rank = record["parameters"]["total"], record["parameters"]["per_rank"]
    assert len(per_rank) == 2 and sum(per_rank) == total and max(per_rank) <= total / 2 + 64  # each holds about half
    saved = load_file(out / "model.safetensors")
    config = transformers.AutoConfig.from_pretrained(out)
    full = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: tuple(v.shape) for k, v in full.items()}
    assert sum(v.numel() for v in saved.values()) == total
    assert all(torch.isfinite(v).all() for v in saved.values())


# --- compare ---------------------------------------------------------------------------------------


def test_compare_reports_lm_tasks(workdir, env, monkeypatch):
    base = workdir / "compare_base.yaml"
    base.write_text(yaml.safe_dump({**TINY_LM, "output_dir": str(workdir / "unused"), "max_steps": 2,
                                    "variant": "sdpa", "variant_params": {}, "generate_new_tokens": 2}))  # fmt: skip
    config = workdir / "compare_lm.yaml"
    config.write_text(yaml.safe_dump({
        "launcher": None,
        "variants": [{"variant": "linear"}, {"name": "sdpa-128", "variant": "sdpa", "max_length": 128}],
        "tasks": [{"name": "gutenberg_lm", "config": str(base)}],
    }))  # fmt: skip
    for key in ("ATTENTION_ZOO_CACHE", "OMP_NUM_THREADS", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, env[key])
    out = workdir / "compare"
    summary = compare.compare(str(config), str(out))
    assert [r["status"] for r in summary] == ["ok", "ok"]
    assert all(r["eval_perplexity"] > 1 and r["decode_tokens_per_second"] > 0 for r in summary)
    assert [len(r["loss_by_position"]) for r in summary] == [2, 1]
    for name in ("results.md", "results.csv", "results.json", "lra_gutenberg_lm.png", "perplexity_gutenberg_lm.png",
                 "loss_by_position_gutenberg_lm.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    report = (out / "results.md").read_text()
    assert "| perplexity |" in report and "| [128,256) |" in report
    assert "decode tok/s" in report and "loss_by_position_gutenberg_lm.png" in report
