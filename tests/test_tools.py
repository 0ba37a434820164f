"""Issue 26: the zoo under the tools people train and ship with -- mixed precision in Trainer, torch.compile and
torch.export, variant state across Trainer / accelerate / peft resumes and gradient checkpointing, switching the
implementation away, torch.jit.trace. Tiny models, short inputs (2 shared CPU cores)."""

from __future__ import annotations

import pytest
import torch
import transformers

from zoo.testing import model_inputs, tiny_model_config


class _Rows(torch.utils.data.Dataset):
    """A few fixed causal-LM rows (the last one right-padded), for plain Trainer runs."""

    def __init__(self, rows: int = 8, n: int = 48):
        ids, mask = model_inputs(n=n, batch=rows)
        self.items = [
            {"input_ids": i, "attention_mask": m, "labels": i.masked_fill(m == 0, -100)}
            for i, m in zip(ids, mask, strict=True)
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _tiny_llama(name: str, **params) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_model_config("llama", name, **params))


def _args(out, **overrides) -> transformers.TrainingArguments:
    defaults = dict(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3, save_strategy="no",
        report_to=[], disable_tqdm=True, use_cpu=True, seed=3, logging_steps=1, dataloader_num_workers=0,
    )
    return transformers.TrainingArguments(**{**defaults, **overrides})


# ---------------------------------------------------------------------------------------------------------
# 1. mixed precision


@pytest.mark.parametrize("name", ["sdpa", "longformer"])
def test_trainer_bf16_trains_a_llama(tmp_path, name):
    model = _tiny_llama(name)
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, bf16=True), train_dataset=_Rows())
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
