"""Two DDP steps of a tiny BERT (a tiny Llama for causal-only variants) with every built-in variant, in one launch
(``tests/test_recipes.py`` starts it with ``recipes/accelerate/multi_cpu.yaml``). DDP is set up as the fine-tune
sets it up (:func:`zoo.training.finetune.find_unused_parameters`), so a variant that leaves a parameter without a
gradient and does not declare it fails here at its second step."""

import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel

import zoo
from zoo.training import finetune as train
from zoo.training.config import FinetuneConfig

TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "vocab_size": 50, "max_position_embeddings": 64, "attention_probs_dropout_prob": 0.0}  # fmt: skip
TINY_LLAMA = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
              "vocab_size": 50, "max_position_embeddings": 64, "attention_dropout": 0.0}  # fmt: skip


def built_in_variants() -> list[str]:
    return [name for name in zoo.list_variants() if zoo.get_variant_class(name).__module__.startswith("zoo.variants")]


def two_steps(name: str) -> None:
    cls = zoo.get_variant_class(name)
    params = dict(cls.test_params)
    family = "bert" if cls.supports_bidirectional else "llama"
    cfg = FinetuneConfig(task="listops", output_dir="unused", model_config={"model_type": family},
                               variant=name, variant_params=params)  # fmt: skip
    if family == "bert":
        config = transformers.BertConfig(**TINY_BERT, num_labels=3)
        model_class = transformers.BertForSequenceClassification
    else:
        config = transformers.LlamaConfig(**TINY_LLAMA, num_labels=3, pad_token_id=0)
        model_class = transformers.LlamaForSequenceClassification
    zoo.configure(config, name, **params)
    torch.manual_seed(0)
    model = model_class(config)
    model.set_attn_implementation(zoo.IMPLEMENTATION)
    ddp = DistributedDataParallel(model, find_unused_parameters=train.find_unused_parameters(cfg))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        ids = torch.randint(1, 50, (2, 64), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, 40:] = 0
        loss = ddp(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 2])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def report(line: str) -> None:
    """One write per line: the ranks share the pipe, and print's separate newline write lets their lines interleave."""
    os.write(sys.stdout.fileno(), f"rank {dist.get_rank()} {line}\n".encode())


def main() -> None:
    dist.init_process_group("gloo")
    failed = []
    for name in built_in_variants():
        try:
            two_steps(name)
            report(f"DDP ok: {name}")
        except Exception as exc:  # noqa: BLE001 -- report every variant, then fail
            failed.append(name)
            report(f"DDP failed: {name}: {type(exc).__name__}: {str(exc)[:300]}")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
