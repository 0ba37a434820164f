"""Compiled vs eager speed of a tiny Llama training step (forward + backward) per variant, in one process.

    .venv/bin/python scripts/compile_speed.py --n 2048 --variants sdpa,longformer,linear

Llama hidden 256, 4 heads (2 key/value heads), 2 layers, batch 1, fp32, CPU; torch.compile with inductor. Prints the
graph breaks (torch._dynamo.explain, padded and unpadded batch), the first compiled call (compilation included) and
the median of ``--repeats`` steps eager and compiled (alternated, so a busy machine slows both alike), and their ratio
(same run: compare ratios, not times).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo
import transformers

import zoo


def model_for(name: str, n: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=n, pad_token_id=0,
    )
    params = {"window": 256} if name == "longformer" else {}
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(zoo.configure(config, name, **params)).train()


def step(model, ids, mask) -> float:
    start = time.perf_counter()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--variants", default="sdpa,longformer,linear")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ids = torch.randint(3, 256, (1, args.n), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)
    padded = ones.clone()
    padded[:, -args.n // 8 :] = 0
    print(f"n={args.n}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.variants.split(","):
        model = model_for(name, args.n)
        breaks = []
        for mask in (padded, ones):
            torch._dynamo.reset()
            breaks.append(torch._dynamo.explain(model.eval())(input_ids=ids, attention_mask=mask).graph_break_count)
        model.train()
        torch._dynamo.reset()
        step(model, ids, ones)  # warm-up
        compiled_model = torch.compile(model)
        first = step(compiled_model, ids, ones)
        times = [(step(model, ids, ones), step(compiled_model, ids, ones)) for _ in range(args.repeats)]
        eager, compiled = (statistics.median(column) for column in zip(*times, strict=True))  # alternated steps
        print(f"{name:12s} breaks padded/unpadded {breaks[0]}/{breaks[1]}  eager {eager:.3f}s  "
              f"compiled {compiled:.3f}s (first call {first:.1f}s)  eager/compiled {eager / compiled:.2f}")


if __name__ == "__main__":
    main()
