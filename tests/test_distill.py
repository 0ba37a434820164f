"""What trains and distillation (``trainable``, ``lora``, ``distill_*``; zoo/training/distill.py): the KL against a
direct computation, the mixed loss of the Trainer at both ends of its weight, the refusals before any data, and a
fine-tune of a pretrained decoder that swaps in ``gated_deltanet``, trains its weights and LoRA adapters by
distillation from the original and saves a plain model (adapters merged, the frozen weights untouched)."""

import copy
import json
import shutil

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file
from test_lm import ACCELERATE, TINY_LM, env, run_recipe, workdir  # noqa: F401  (module fixtures)

from zoo.plug.install import configure
from zoo.training import finetune as train
from zoo.training.config import FinetuneConfig
from zoo.training.distill import DistillingTrainer, merge_lora, select_trainable, token_kl

TINY_LLAMA = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64)  # fmt: skip


def tiny_pair():
    torch.manual_seed(0)
    student = transformers.LlamaForCausalLM(copy.deepcopy(TINY_LLAMA))
    teacher = copy.deepcopy(student).eval()
    with torch.no_grad():
        for parameter in teacher.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return student, teacher


def batch():
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, :5] = -100  # a padded row: its first positions predict nothing
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def test_token_kl_matches_a_direct_sum_over_the_predicted_positions():
    student, teacher = torch.randn(2, 12, 64), torch.randn(2, 12, 64)
    labels = batch()["labels"]
    for temperature in (1.0, 2.0):
        kl, tokens = token_kl(student, teacher, labels, temperature)
        expected, count = 0.0, 0
        for row in range(2):
            for position in range(11):
                if labels[row, position + 1] == -100:
                    continue
                p = torch.softmax(teacher[row, position] / temperature, -1)
                q = torch.softmax(student[row, position] / temperature, -1)
                expected += float((p * (p.log() - q.log())).sum()) * temperature**2
                count += 1
        assert int(tokens) == count == 11 + 7
        assert float(kl) == pytest.approx(expected, rel=1e-5)
    same, _ = token_kl(student, student, labels, 1.0)
    assert float(same) == pytest.approx(0.0, abs=1e-5)


def test_distilling_trainer_mixes_the_lm_loss_and_the_kl(tmp_path):
    student, teacher = tiny_pair()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    inputs = batch()
    student.train()
    with torch.no_grad():
        lm_loss = float(student(**inputs).loss)
        kl, tokens = token_kl(student(**inputs).logits, teacher(**inputs).logits, inputs["labels"], 1.0)
    kl = float(kl / tokens)
    for weight, expected in ((0.0, lm_loss), (1.0, kl), (0.25, 0.75 * lm_loss + 0.25 * kl)):
        trainer = DistillingTrainer(model=student, args=args, teacher=teacher, weight=weight, temperature=1.0)
        assert float(trainer.compute_loss(student, dict(inputs)).detach()) == pytest.approx(expected, rel=1e-5)
    trainer = DistillingTrainer(model=student, args=args, teacher=copy.deepcopy(student), weight=1.0, temperature=2.0)
    assert float(trainer.compute_loss(student, dict(inputs)).detach()) == pytest.approx(0.0, abs=1e-5)
    student.eval()  # evaluation: the LM loss alone (perplexity)
    assert float(trainer.compute_loss(student, dict(inputs))) == pytest.approx(float(student(**inputs).loss), rel=1e-5)


def test_trainable_variant_with_lora_trains_the_variant_and_the_adapters_only():
    student, _ = tiny_pair()
    configure(student, "gated_deltanet", short_conv=4)
    count = select_trainable(student, "variant", {"r": 4, "target_modules": ["q_proj", "v_proj"]})
    trained = {name for name, p in student.named_parameters() if p.requires_grad}
    assert trained and all(".attention_zoo." in name or "lora_" in name for name in trained)
    assert any("lora_A" in name for name in trained) and any(".attention_zoo." in name for name in trained)
    assert count == sum(p.numel() for name, p in student.named_parameters() if name in trained)
    layer = student.model.layers[0].self_attn
    with torch.no_grad():
        layer.q_proj.lora_B["default"].weight.fill_(0.1)  # a non-zero update to fold in
    ids = batch()["input_ids"]
    before = student(input_ids=ids).logits
    assert merge_lora(student) == 4  # q and v of 2 layers
    assert not any("lora_" in name for name, _ in student.named_parameters())
    assert isinstance(layer.q_proj, torch.nn.Linear)
    torch.testing.assert_close(student(input_ids=ids).logits, before, atol=1e-5, rtol=1e-5)
    plain, _ = tiny_pair()
    with pytest.raises(ValueError, match="selects no parameter"):
        select_trainable(plain, "variant", None)  # sdpa has no learned weights


@pytest.mark.parametrize(("overrides", "message"), [
    ({"trainable": "encoder"}, "'trainable' must be one of all, attention, variant"),
    ({"lora": {"r": 4}}, "lora with trainable: all"),
    ({"lora": {"r": 4}, "trainable": "variant", "resume_weights_only": True, "resume_from_checkpoint": "x"},
     "resume_weights_only cannot restore LoRA"),
    ({"distill_from": "teacher", "distill_weight": 1.5}, "'distill_weight' must lie in"),
    ({"distill_from": "teacher", "distill_temperature": 0.0}, "'distill_temperature' must be above 0"),
    ({"distill_from": "teacher", "task": "listops", "task_options": {}}, "does not train a causal language model"),
])  # fmt: skip
def test_training_keys_are_refused_before_any_data(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(train.tasks, "build_task", lambda *a, **k: pytest.fail("data loaded before the check"))
    with pytest.raises(ValueError, match=message):
        train.run(FinetuneConfig(**{**TINY_LM, "output_dir": str(tmp_path / "out"), **overrides}))


@pytest.fixture(scope="module")
def pretrained(workdir, env):  # noqa: F811
    """A decoder trained from scratch for 8 steps with SDPA: the teacher and the starting point."""
    config = workdir / "teacher.yaml"
    config.write_text(yaml.safe_dump({**TINY_LM, "variant": "sdpa", "variant_params": {}, "generate_new_tokens": 0,
                                      "output_dir": str(workdir / "teacher")}))  # fmt: skip
    run_recipe(config, env)
    return workdir / "teacher"


STUDENT = {**TINY_LM, "model_config": None, "variant": "gated_deltanet", "variant_params": {"short_conv": 4},
           "generate_new_tokens": 0, "trainable": "variant", "distill_weight": 1.0, "max_steps": 8,
           "logging_steps": 2, "save_strategy": "steps", "save_steps": 4,
           "lora": {"r": 4, "target_modules": ["q_proj", "k_proj", "v_proj"]}}  # fmt: skip


@pytest.fixture(scope="module")
def student(pretrained, workdir, env):  # noqa: F811
    """The pretrained decoder with gated_deltanet swapped in, its weights and LoRA trained by distillation alone."""
    out = workdir / "student"
    config = workdir / "student.yaml"
    config.write_text(yaml.safe_dump({**STUDENT, "model_name_or_path": str(pretrained), "output_dir": str(out),
                                      "distill_from": str(pretrained)}))  # fmt: skip
    run_recipe(config, env)
    return config, out


def test_distilled_retrofit_saves_a_plain_model_with_only_the_attention_changed(pretrained, student):
    _, out = student
    kl = logged_kl(out)
    assert len(kl) == 4 and all(value >= 0 for value in kl)
    assert kl[-1] < kl[0]  # the student moves toward the teacher
    saved, original = load_file(out / "model.safetensors"), load_file(pretrained / "model.safetensors")
    assert not [name for name in saved if "lora_" in name]
    assert any(".attention_zoo." in name for name in saved)
    for name, tensor in original.items():
        changed = not torch.equal(saved[name], tensor)
        assert changed == any(f"self_attn.{p}_proj" in name for p in "qkv"), name  # LoRA merged; the rest frozen
    checkpoint = load_file(out / "checkpoint-4" / "model.safetensors")
    assert any("lora_A" in name for name in checkpoint)  # checkpoints hold the adapters: a resume is exact
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora_" in name for name, _ in model.named_parameters())


def logged_kl(folder):
    return [row["distill_kl"] for row in map(json.loads, (folder / "train_log.jsonl").read_text().splitlines())
            if "distill_kl" in row]  # fmt: skip


def test_a_resumed_distillation_matches_the_uninterrupted_one(student, workdir, env):  # noqa: F811
    config, out = student
    resumed = workdir / "student_resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-4", resumed / "checkpoint-4")
    run_recipe(config, env, "--output_dir", resumed, "--resume_from_checkpoint", "true")
    weights, reference = load_file(resumed / "model.safetensors"), load_file(out / "model.safetensors")
    assert weights.keys() == reference.keys()
    assert all(torch.allclose(weights[name], reference[name], atol=1e-6) for name in reference)
    assert logged_kl(resumed) == pytest.approx(logged_kl(out)[2:], rel=1e-5)  # the logs of steps 6 and 8


@pytest.mark.slow
def test_distillation_under_two_ddp_processes(pretrained, workdir, env):  # noqa: F811
    out = workdir / "student_ddp"
    config = workdir / "student_ddp.yaml"
    config.write_text(yaml.safe_dump({**STUDENT, "model_name_or_path": str(pretrained), "output_dir": str(out),
                                      "distill_from": str(pretrained), "max_steps": 2, "save_strategy": "no"}))
    run_recipe(config, env, launcher=ACCELERATE / "multi_cpu.yaml")
    record = json.loads((out / "results.json").read_text())
    assert record["num_processes"] == 2 and record["distributed_type"] == "DDP"
    assert [value > 0 for value in logged_kl(out)] == [True]
    assert not [name for name in load_file(out / "model.safetensors") if "lora_" in name]
