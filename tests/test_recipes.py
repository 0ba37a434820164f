"""End-to-end recipe runs on tiny configs: outputs, 2 gloo processes, resume, clear errors, compare."""

import collections
import csv
import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from accelerate.utils import FullyShardedDataParallelPlugin
from safetensors.torch import load_file

import zoo
from zoo.convert.longify import PositionLimitError
from zoo.data import UnknownTaskError, build_task
from zoo.training import compare, distributed, run_folder
from zoo.training import finetune as train
from zoo.training.config import FinetuneConfig, check_config, parse_config
from zoo.training.run_lock import RunLock, RunLockedError

REPO = Path(__file__).resolve().parents[1]
MULTI_CPU = REPO / "recipes" / "accelerate" / "multi_cpu.yaml"
FSDP = REPO / "recipes" / "accelerate" / "fsdp.yaml"
RESULTS_KEYS = {
    "task", "dataset", "variant", "variant_params", "variant_package", "variant_version", "model", "base_model",
    "model_type", "architecture", "max_length", "num_labels", "label_names", "num_processes", "seed", "metrics",
    "train_tokens_per_second", "eval_tokens_per_second", "peak_memory_mb", "wall_time_seconds", "train_examples",
    "eval_examples", "max_steps", "num_train_epochs", "packages", "numerics", "config", "distributed_type",
    "accelerate_distributed_type", "world_size", "parameters", "training_curves",
}  # fmt: skip
# 40 train examples, batch 8: 5 steps per epoch, so 8 steps cross an epoch and a resume at step 4 lands mid-epoch.
# 13 test examples: not a multiple of 2 processes x 4, so the last evaluation batch is padded with repeats.
TINY = {
    "task": "listops",
    "task_options": {"train_size": 40, "validation_size": 6, "test_size": 13, "min_length": 10, "max_length": 60},
    "model_config": {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "intermediate_size": 64},
    "max_length": 64,
    "variant": "sdpa",
    "learning_rate": 1.0e-3,
    "max_steps": 8,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 4,
    "save_steps": 4,
    "logging_steps": 2,
    "disable_tqdm": True,
    "seed": 7,
}  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("recipes")


@pytest.fixture(scope="module")
def env(workdir):
    """Subprocess environment: a private data cache, no Hub, one thread per process (the cores are shared)."""
    return {**os.environ, "ATTENTION_ZOO_CACHE": str(workdir / "cache"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def private_cache(env, monkeypatch):
    """In-process runs use the same private data cache as the subprocesses."""
    monkeypatch.setenv("ATTENTION_ZOO_CACHE", env["ATTENTION_ZOO_CACHE"])


@pytest.fixture(scope="module")
def tiny_config(workdir):
    path = workdir / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": str(workdir / "unused")}))
    return path


def launch_prefix(launcher=None, script=("-m", "zoo.training.finetune")) -> list[str]:
    """python, or accelerate with a launcher file (fsdp.yaml: 2 processes, no mixed precision, as on this CPU)."""
    if not launcher:
        return [sys.executable, *script]
    prefix = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launcher)]
    if Path(launcher) == FSDP:
        prefix += ["--num_processes", "2", "--mixed_precision", "no"]
    return [*prefix, *script]


def finetune(config, env, *overrides, launcher=None, check=True):
    command = [*launch_prefix(launcher), str(config), *map(str, overrides)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def results(output_dir):
    return json.loads((Path(output_dir) / "results.json").read_text())


@pytest.fixture(scope="module")
def full_run(workdir, tiny_config, env):
    out = workdir / "full"
    finetune(tiny_config, env, "--output_dir", out)
    return out


def test_smoke_finetune_writes_every_output(full_run):
    names = {p.name for p in full_run.iterdir()}
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "results.json",
                "train_log.jsonl", "trainer_state.json", "eval_predictions.csv", "checkpoint-4"}  # fmt: skip
    assert expected <= names
    assert "README.md" in names and not any(n.endswith((".bin", ".pt", ".pkl")) for n in names), names
    record = results(full_run)
    assert set(record) == RESULTS_KEYS
    assert record["variant"] == "sdpa" and record["num_processes"] == 1 and record["base_model"] is None
    assert record["training_curves"] == {}  # sdpa logs no auxiliary loss (dsa's indexer_kl, distillation's distill_kl)
    assert set(record["metrics"]) == {"eval_accuracy", "eval_macro_f1", "eval_loss"}
    assert record["eval_examples"] == 13 and record["train_examples"] == 40 and record["max_steps"] == 8
    assert record["label_names"] == [str(d) for d in range(10)]
    assert record["architecture"] == "BertForSequenceClassification"
    assert record["train_tokens_per_second"] > 0 and record["peak_memory_mb"] > 50
    assert record["config"]["output_dir"] == str(full_run)
    logged = [json.loads(line) for line in (full_run / "train_log.jsonl").read_text().splitlines()]
    assert any("loss" in entry for entry in logged)
    if "README.md" not in names:
        pytest.importorskip("zoo.hub.card")  # the model card is written whenever zoo.hub.card exists
        raise AssertionError("zoo.hub.card exists but README.md was not written")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(full_run)
    assert zoo.variant_spec(model.config)["variant"] == "sdpa"
    assert model.config.attention_probs_dropout_prob == 0.0


def test_two_processes_count_every_eval_example_once(workdir, tiny_config, env):
    out = workdir / "two"
    finetune(tiny_config, env, "--output_dir", out, "--save_strategy", "no", launcher=MULTI_CPU)
    record = results(out)
    assert record["num_processes"] == 2 and record["eval_examples"] == 13
    assert record["distributed_type"] == "DDP" and record["world_size"] == 2
    with open(out / "eval_predictions.csv") as fh:
        rows = list(csv.DictReader(fh))
    test_split = build_task("listops", **TINY["task_options"])["test"]
    assert len(rows) == 13
    assert collections.Counter(r["label"] for r in rows) == collections.Counter(str(x) for x in test_split["label"])
    accuracy = sum(r["label"] == r["prediction"] for r in rows) / 13
    assert accuracy == pytest.approx(record["metrics"]["eval_accuracy"])


def test_every_built_in_variant_trains_under_two_ddp_processes(env):
    """One launch, every built-in variant: DDP set up as the recipe sets it up (reformer leaves its key projection
    without a gradient; with find_unused_parameters=False, as before, it failed at its second step)."""
    command = launch_prefix(MULTI_CPU, script=[str(REPO / "tests" / "ddp_variants.py")])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trained = set(re.findall(r"rank 0 DDP ok: (\w+)", done.stdout))
    built_in = {n for n in zoo.list_variants() if zoo.get_variant_class(n).__module__.startswith("zoo.variants")}
    assert trained == built_in and "reformer" in trained


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [MULTI_CPU, FSDP], ids=["ddp", "fsdp"])
def test_reformer_recipe_trains_under_two_processes(workdir, tiny_config, env, launcher):
    out = workdir / f"reformer-{launcher.stem}"
    finetune(tiny_config, env, "--output_dir", out, "--variant", "reformer", "--variant_params", "{bucket_size: 16}",
             "--max_steps", 3, "--save_strategy", "no", launcher=launcher)  # fmt: skip
    record = results(out)
    assert record["variant"] == "reformer" and record["world_size"] == 2
    assert record["distributed_type"] == ("FSDP" if launcher == FSDP else "DDP")


def test_fsdp_wraps_no_module_that_holds_the_input_embeddings():
    """accelerate shards the input embeddings as their own unit after the per-layer units; BERT lists BertEmbeddings
    among its _no_split_modules, and sharding it first made that second fully_shard fail for every BERT model."""
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**TINY["model_config"]))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    distributed.keep_input_embeddings_unwrapped(plugin, model)
    assert plugin.transformer_cls_names_to_wrap == ["BertLayer"]


def test_resume_from_checkpoint_matches_an_uninterrupted_run(workdir, tiny_config, env, full_run):
    out = workdir / "resumed"
    out.mkdir()
    shutil.copytree(full_run / "checkpoint-4", out / "checkpoint-4")  # as if the run had stopped after step 4
    finetune(tiny_config, env, "--output_dir", out, "--resume_from_checkpoint", "true")
    resumed, uninterrupted = results(out)["metrics"], results(full_run)["metrics"]
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)  # without the RNG state or data position: ~1e-4 apart
    weights, reference = load_file(out / "model.safetensors"), load_file(full_run / "model.safetensors")
    assert all(torch.allclose(weights[name], reference[name], atol=1e-6) for name in reference)
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert min(steps) > 4  # it trained only the remaining steps


# --- clear errors before training ------------------------------------------------------------------


def config(tmp_path, **overrides):
    return FinetuneConfig(**{**TINY, "output_dir": str(tmp_path / "out"), **overrides})


def test_a_fine_tune_resolves_its_config_once_and_its_model_runs_that_variant(tmp_path):
    """check_config builds the variant and looks the task up once; the model's config runs that very instance
    (no rebuild from the dict), and an edit of the config's entry still builds the edited variant."""
    from zoo.plug.install import configure_variant
    from zoo.plug.spec import CONFIG_KEY, variant_for

    cfg = config(tmp_path, variant="longformer", variant_params={"window": 8})
    resolved = check_config(cfg)
    assert resolved.variant.config["window"] == 8 and resolved.task.kind == "classification"
    assert train.find_unused_parameters(resolved) is (not resolved.variant.trains_every_parameter)
    hf = configure_variant(transformers.BertConfig(**{k: TINY["model_config"][k] for k in TINY["model_config"]
                                                      if k != "model_type"}), resolved.variant, "longformer")
    assert variant_for(hf) is resolved.variant
    assert getattr(hf, CONFIG_KEY)["variant"] == "longformer"
    getattr(hf, CONFIG_KEY)["params"]["window"] = 4  # edited in place: the memo notices
    assert variant_for(hf) is not resolved.variant and variant_for(hf).config["window"] == 4


def test_config_file_values_are_overridden_on_the_command_line(tiny_config):
    cfg = parse_config([str(tiny_config), "--max_steps", "3", "--variant_params", "{window: 16}"])
    assert cfg.max_steps == 3 and cfg.variant_params == {"window": 16} and cfg.learning_rate == 1e-3
    assert cfg.task_options["train_size"] == 40


def test_unknown_config_key_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": "x", "learning_rte": 0.1}))
    with pytest.raises(ValueError, match="unknown key 'learning_rte'. Did you mean 'learning_rate'"):
        parse_config([str(path)])


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_steps", 12.5, "'max_steps' must be an integer, got 12.5"),
        ("seed", 4.5, "'seed' must be an integer, got 4.5"),
        ("max_length", [128], "'max_length' must be an integer, got \\[128\\]"),
        ("learning_rate", -0.1, "'learning_rate' must be at least 0"),
        ("max_train_examples", 0, "'max_train_examples' must be at least 1"),
        ("max_eval_examples", 0, "'max_eval_examples' must be at least 1"),
        ("max_steps", 0, "'max_steps' must be a positive integer, or -1"),
        ("save_strategy", "sometimes", "'save_strategy' must be one of no, steps, epoch"),
    ],
)
def test_wrong_config_values_name_the_key_when_parsed(tmp_path, key, value, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": "x", key: value}))
    with pytest.raises(ValueError, match=message):
        parse_config([str(path)])


def test_a_key_written_twice_is_an_error_in_finetune_and_compare_configs(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": "x"}) + "seed: 8\n")
    with pytest.raises(ValueError, match="key 'seed' appears twice"):
        parse_config([str(path)])
    path.write_text("launcher: null\ntasks: []\nlauncher: null\n")
    with pytest.raises(ValueError, match="key 'launcher' appears twice"):
        compare.load_compare_config(str(path))


def test_activation_checkpointing_reaches_trainer_and_saves_memory(tmp_path):
    """The key is TrainingArguments' own (transformers 5.x; ``gradient_checkpointing`` is its deprecated alias)."""
    assert train.training_arguments(config(tmp_path, activation_checkpointing=True)).activation_checkpointing
    assert not train.training_arguments(config(tmp_path)).activation_checkpointing

    def saved_bytes(checkpointing: bool) -> int:
        bert = transformers.BertConfig(**{**TINY["model_config"], "num_hidden_layers": 4}, vocab_size=40)
        model = transformers.BertForSequenceClassification(zoo.configure(bert, "longformer", window=8)).train()
        model.set_attn_implementation(zoo.IMPLEMENTATION)
        if checkpointing:
            model.activation_checkpointing_enable()  # what Trainer does when activation_checkpointing is set
        total = 0

        def pack(tensor):
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # kept for backward by the forward
            loss = model(input_ids=torch.randint(1, 40, (2, 64)), labels=torch.tensor([0, 1])).loss
        loss.backward()  # recomputes the checkpointed layers
        return total

    assert saved_bytes(True) < 0.6 * saved_bytes(False)


def test_unknown_task_is_refused(tmp_path):
    with pytest.raises(UnknownTaskError, match="unknown task 'lisops'"):
        train.run(config(tmp_path, task="lisops"))


def test_missing_text_or_label_column_is_refused(tmp_path):
    rows = [json.dumps({"body": "a b", "label": i % 2}) for i in range(20)]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    options = {"path": "json", "data_files": str(tmp_path / "train.jsonl"), "text_column": "content"}
    with pytest.raises(ValueError, match="no text column 'content'; its columns are body, label"):
        train.run(config(tmp_path, task="hub", task_options=options, tokenizer_name_or_path="minilm"))


def test_max_length_beyond_the_positions_without_longify_is_refused(tmp_path):
    cfg = config(tmp_path, model_config=None, model_name_or_path="minilm", max_length=1024)
    with pytest.raises(PositionLimitError, match="exceeds the 512 positions.*longify: true"):
        train.run(cfg)


def test_variant_without_causal_support_is_refused_for_a_decoder(tmp_path):
    @zoo.register_variant
    class BidirectionalOnly(zoo.Variant):
        name = "test_bidirectional_only"
        supports_causal = False

    llama = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 2, "intermediate_size": 64}  # fmt: skip
    try:
        with pytest.raises(ValueError, match="does not support causal attention"):
            train.run(config(tmp_path, model_config=llama, variant="test_bidirectional_only"))
    finally:
        zoo.unregister_variant("test_bidirectional_only")


def test_output_dir_holding_another_run_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.json").write_text("{}")
    expected = "already holds a run.*--resume_from_checkpoint true.*--overwrite_output_dir"
    with pytest.raises(FileExistsError, match=expected):
        check_config(config(tmp_path))
    check_config(config(tmp_path, overwrite_output_dir=True))
    check_config(config(tmp_path, resume_from_checkpoint="true"))


def test_push_without_a_repository_id_is_refused(tmp_path):
    with pytest.raises(ValueError, match="hub_model_id"):
        check_config(config(tmp_path, push_to_hub=True))


# --- compare --------------------------------------------------------------------------------------


def test_compare_records_failures_and_writes_the_report(workdir, tiny_config, env, monkeypatch):
    compare_config = workdir / "compare.yaml"
    compare_config.write_text(yaml.safe_dump({
        "launcher": None,
        "overrides": {"max_steps": 2, "save_strategy": "no"},
        "variants": [
            {"variant": "sdpa"},
            {"name": "broken", "variant": "longformer", "variant_params": {"window": -4}},
            {"variant": "no_such_variant"},
        ],
        "tasks": [{"name": "listops", "config": str(tiny_config)}],
    }))  # fmt: skip
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = workdir / "compare"
    summary = compare.compare(str(compare_config), str(out))
    status = {row["name"]: row["status"] for row in summary}
    assert status == {"sdpa": "ok", "broken": "failed", "no_such_variant": "unavailable"}
    by_name = {row["name"]: row for row in summary}
    assert "window" in by_name["broken"]["error"] and "no_such_variant" in by_name["no_such_variant"]["error"]
    assert by_name["sdpa"]["eval_accuracy"] is not None
    for name in ("results.md", "results.csv", "results.json", "lra_listops.png", "accuracy_listops.png"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "results.md").read_text()
    assert "| sdpa |" in report and "unavailable" in report
    with open(out / "results.csv") as fh:
        assert [row["name"] for row in csv.DictReader(fh)] == ["sdpa", "broken", "no_such_variant"]
    with pytest.raises(FileExistsError, match="--overwrite"):
        compare.compare(str(compare_config), str(out))


TORCHRUN_LOG = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "zoo/train.py", line 597, in run
[rank0]: RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one.
[rank1]: Traceback (most recent call last):
[rank1]: torch.distributed.DistBackendError: Connection closed by peer
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 7625)
  traceback : Signal 15 (SIGTERM) received by PID 7625
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 7621)
"""


def test_a_failed_launch_reports_the_first_failing_ranks_exception(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(TORCHRUN_LOG)
    assert compare.last_error(log) == (
        "rank 0: RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one."
    )
    log.write_text(TORCHRUN_LOG.replace("Root Cause", "Root").replace("[rank0]", "[rank2]"))
    assert compare.last_error(log).startswith("rank 2: RuntimeError")  # no root cause named: the first to raise


def test_compare_exits_non_zero_after_reporting_a_failed_run(workdir, tiny_config, tmp_path, monkeypatch):
    compare_config = tmp_path / "compare.yaml"
    compare_config.write_text(yaml.safe_dump({
        "variants": [{"name": "broken", "variant": "longformer", "variant_params": {"window": -4}}],
        "tasks": [{"name": "listops", "config": str(tiny_config)}],
    }))  # fmt: skip
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(SystemExit, match=r"1 run\(s\) did not finish.*listops / broken: failed"):
        compare.main([str(compare_config), "--output_dir", str(tmp_path / "out")])
    assert "**broken** (failed)" in (tmp_path / "out" / "results.md").read_text()


# --- shipped configs ------------------------------------------------------------------------------

CONFIGS = REPO / "recipes" / "configs"
EVAL_CONFIGS = CONFIGS / "eval"  # `zoo eval` configs, checked in tests/eval
RETROFIT_CONFIGS = CONFIGS / "retrofit"  # the retrofit recipe's, checked in tests/test_retrofit.py
DUO_CONFIGS = CONFIGS / "duo"  # recipes/duo.py's, checked in tests/test_duo_heads.py
FINETUNE_CONFIGS = sorted(
    p for p in CONFIGS.rglob("*.yaml")
    if not p.name.startswith("compare") and not {EVAL_CONFIGS, RETROFIT_CONFIGS, DUO_CONFIGS} & set(p.parents)
)
COMPARE_CONFIGS = sorted(CONFIGS.glob("compare*.yaml"))


@pytest.mark.parametrize("path", FINETUNE_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shipped_finetune_configs_are_valid(path, tmp_path):
    cfg = parse_config([str(path), "--output_dir", str(tmp_path / "out")])
    check_config(cfg)
    train.training_arguments(cfg)


@pytest.mark.parametrize("path", COMPARE_CONFIGS, ids=lambda p: p.name)
def test_shipped_compare_configs_plan_their_runs(path, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    runs = compare.plan_runs(compare.load_compare_config(str(path)), tmp_path)
    assert len({(r.task, r.name) for r in runs}) >= 4
    assert any(r.config.get("variant") == "sdpa" for r in runs)


# --- resume: exact or refused ----------------------------------------------------------------------


def resume_folder(tmp_path, full_run, *checkpoints):
    """An output_dir holding copies of the full run's checkpoints (checkpoint-4: mid-run, checkpoint-8: the end)."""
    out = tmp_path / "out"
    out.mkdir()
    for name in checkpoints:
        shutil.copytree(full_run / name, out / name)
    return out


def test_checkpoint_without_optimizer_state_is_refused_unless_weights_only(tmp_path, full_run):
    out = resume_folder(tmp_path, full_run, "checkpoint-4")
    (out / "checkpoint-4" / "optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"optimizer.pt \(missing\).*resume_weights_only: true"):
        run_folder.resume_plan(config(tmp_path, resume_from_checkpoint=str(out / "checkpoint-4")))
    plan = run_folder.resume_plan(config(tmp_path, resume_from_checkpoint="true", resume_weights_only=True))
    assert plan.weights == str(out / "checkpoint-4") and plan.checkpoint is None  # step 0, fresh optimizer


def test_an_fsdp_checkpoint_counts_as_complete(tmp_path):
    """Under FSDP, transformers' Trainer saves the optimizer as optimizer.bin (or a sharded optimizer_0 folder)."""
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    for name in ("model.safetensors", "pytorch_model_fsdp.bin", "optimizer.bin", "scheduler.pt"):
        (checkpoint / name).write_bytes(b"x")
    (checkpoint / "trainer_state.json").write_text("{}")
    for rank in (0, 1):
        torch.save({}, checkpoint / f"rng_state_{rank}.pth")
    assert run_folder.missing_files(checkpoint) == []
    (checkpoint / "optimizer.bin").unlink()
    assert run_folder.missing_files(checkpoint) == ["optimizer.pt (missing)"]


def test_resume_true_skips_an_incomplete_checkpoint_and_says_so(tmp_path, full_run, caplog):
    out = resume_folder(tmp_path, full_run, "checkpoint-4", "checkpoint-8")
    (out / "checkpoint-8" / "rng_state.pth").write_bytes(b"")  # as a full disk left it
    plan = run_folder.resume_plan(config(tmp_path, resume_from_checkpoint="true", max_steps=12))
    assert plan.checkpoint == str(out / "checkpoint-4")
    assert "skipped the incomplete checkpoint-8 (rng_state.pth (unreadable))" in caplog.text
    (out / "checkpoint-4" / "scheduler.pt").unlink()
    with pytest.raises(FileNotFoundError, match="no checkpoint in .* is complete.*scheduler.pt"):
        run_folder.resume_plan(config(tmp_path, resume_from_checkpoint="true"))


def test_resuming_a_finished_run_does_nothing(tmp_path, full_run, caplog):
    out = resume_folder(tmp_path, full_run, "checkpoint-8")
    (out / "results.json").write_text("{}")
    assert train.run(config(tmp_path, resume_from_checkpoint="true")) is None
    assert "at step 8 of max_steps 8: the run is finished" in caplog.text
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-8", "results.json"]
    assert (out / "results.json").read_text() == "{}"


def test_resuming_with_another_variant_or_model_is_refused(tmp_path, full_run):
    resume_folder(tmp_path, full_run, "checkpoint-4")
    resume = {"resume_from_checkpoint": "true"}
    with pytest.raises(ValueError, match="trained with variant 'sdpa'.*asks for 'longformer'"):
        run_folder.resume_plan(config(tmp_path, variant="longformer", variant_params={"window": 8}, **resume))
    bigger = {**TINY["model_config"], "hidden_size": 64}
    with pytest.raises(ValueError, match="another model .*hidden_size: checkpoint 32, this run 64"):
        run_folder.resume_plan(config(tmp_path, model_config=bigger, **resume))


@pytest.mark.slow
def test_weights_only_resume_starts_a_fresh_schedule_from_the_weights(workdir, tiny_config, env, full_run):
    out = workdir / "weights_only"
    out.mkdir()
    shutil.copytree(full_run / "checkpoint-4", out / "checkpoint-4")
    (out / "checkpoint-4" / "optimizer.pt").unlink()
    finetune(tiny_config, env, "--output_dir", out, "--resume_from_checkpoint", out / "checkpoint-4",
             "--resume_weights_only", "true", "--max_steps", 2, "--save_strategy", "no")  # fmt: skip
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert min(steps) == 2 and results(out)["max_steps"] == 2  # counted from step 0


# --- one run per output folder ----------------------------------------------------------------------


def test_a_folder_held_by_a_live_run_is_refused_even_with_overwrite(tmp_path):
    lock = RunLock(tmp_path / "out").acquire()  # this (live) process holds it
    try:
        for overrides in ({}, {"overwrite_output_dir": True}):
            with pytest.raises(RunLockedError, match=re.escape(f"in use by a live run (pid {os.getpid()} ")):
                train.run(config(tmp_path, **overrides))
    finally:
        lock.release()
    assert not (tmp_path / "out" / "run.lock").exists()


def test_a_stale_lock_is_taken_over_and_overwrite_clears_the_previous_run(tmp_path, caplog, monkeypatch):
    out = tmp_path / "out"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "train_log.jsonl").write_text('{"step": 2}\n')
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / "run.lock").write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    lock = run_folder.lock_output_dir(config(tmp_path, overwrite_output_dir=True))
    try:
        assert "taking over" in caplog.text and json.loads((out / "run.lock").read_text())["pid"] == os.getpid()
        assert sorted(p.name for p in out.iterdir()) == ["run.lock"]  # nothing of the previous run left to mix
    finally:
        lock.release()
    monkeypatch.setenv("RANK", "1")  # the other processes of a launch leave the lock to rank 0
    assert not run_folder.lock_output_dir(config(tmp_path)).held and not (out / "run.lock").exists()


# --- checkpoint writes --------------------------------------------------------------------------------


def test_disk_full_while_checkpointing_names_the_folder_and_leaves_nothing_resumable(tmp_path, monkeypatch):
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            Path(f).write_bytes(b"")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    cfg = config(tmp_path, max_steps=2, save_steps=2, eval_strategy="no")
    with pytest.raises(OSError, match=r"writing checkpoint .*checkpoint-2 failed.*No space left.*MB free on"):
        train.run(cfg)
    out = Path(cfg.output_dir)
    assert not (out / "checkpoint-2").exists() and not (out / "run.lock").exists()
