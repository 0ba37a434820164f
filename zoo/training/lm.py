"""Causal language modelling evaluation: loss by token position, perplexity, decode speed and a greedy sample.

Loss by position is the long-context evidence: chunks never cross a document boundary (:mod:`zoo.data.lm`), so the
token at position p of a chunk is predicted from the p tokens of its own document before it. A model that uses
far context has a lower loss in the late buckets than in the first one. Buckets: [0,128), [128,512),
[512,2K), [2K,4K), [4K,8K), ... up to max_length (position 0 is never predicted).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer

from zoo.data.labels import IGNORE_INDEX

DECODE_SPEED_METHOD = (
    "greedy generate() after a warm-up call, batch 1: (new tokens - 1) / time from the first to the last new token "
    "(streamer time stamps; prefill excluded and reported as prefill_seconds)"
)
BUCKET_EDGES = (0, 128, 512, 2048)  # then doubling from 4096


def position_buckets(max_length: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering positions 0 .. max_length - 1."""
    edges = [e for e in BUCKET_EDGES if e < max_length]
    edge = 4096
    while edge < max_length:
        edges.append(edge)
        edge *= 2
    edges.append(max_length)
    return list(zip(edges[:-1], edges[1:], strict=True))


def bucket_name(start: int, end: int) -> str:
    return f"[{_short(start)},{_short(end)})"


def _short(n: int) -> str:
    return f"{n // 1024}K" if n >= 2048 and n % 1024 == 0 else str(n)


def per_token_loss(logits, labels: torch.Tensor) -> torch.Tensor:
    """``preprocess_logits_for_metrics``: (batch, n, vocab) logits -> (batch, n) loss of the token at each position.

    Runs on every evaluation batch before Trainer gathers and stores anything, so the vocabulary-sized logits never
    pile up (a 4K-token chunk at vocab 8K is 128 MB of fp32 logits; its per-token loss is 16 KB). Position 0 (never
    predicted) and ignored labels hold 0; :class:`PositionLoss` masks them with the labels.
    """
    logits = logits[0] if isinstance(logits, tuple) else logits
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), labels[:, 1:], ignore_index=IGNORE_INDEX, reduction="none"
    )
    return torch.nn.functional.pad(losses, (1, 0))


class PositionLoss:
    """compute_metrics for Trainer: mean token loss, perplexity and mean loss per position bucket.

    Trainer hands it the per-token losses of :func:`per_token_loss` and the labels, gathered across processes
    (each chunk exactly once; rows of unequal length padded with -100).
    """

    def __init__(self, max_length: int) -> None:
        self.buckets = position_buckets(max_length)
        self.by_position: list[dict] = []

    def __call__(self, eval_pred) -> dict[str, float]:
        losses = np.asarray(eval_pred.predictions, dtype=np.float64)
        labels = np.asarray(eval_pred.label_ids)
        predicted = labels != IGNORE_INDEX
        predicted[:, 0] = False
        mean = float(losses[predicted].mean())
        metrics = {"token_loss": mean, "perplexity": math.exp(mean)}
        self.by_position = []
        for start, end in self.buckets:
            mask = predicted[:, start:end]
            count = int(mask.sum())
            loss = float(losses[:, start:end][mask].mean()) if count else None
            self.by_position.append({"bucket": bucket_name(start, end), "start": start, "end": end, "loss": loss,
                                     "tokens": count})  # fmt: skip
            if loss is not None:
                metrics[f"loss_{start}_{end}"] = loss
        return metrics


class TokenClock(BaseStreamer):
    """A streamer that records when each batch of tokens arrives (the first ``put`` is the prompt): the decode timer
    of the zoo (the fine-tune's sample, ``zoo bench --decode``, the passkey benchmark).

    Args:
        on_put: called with the number of ``put`` calls so far after each one (e.g. 2: the prefill's token came).
    """

    def __init__(self, on_put: Callable[[int], None] | None = None) -> None:
        self.stamps: list[float] = []
        self.on_put = on_put

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())
        if self.on_put is not None:
            self.on_put(len(self.stamps))

    def end(self) -> None:
        pass

    def token_gaps(self) -> list[float]:
        """Seconds between consecutive generated tokens (prompt and first token, which carries the prefill, out)."""
        generated = self.stamps[1:]
        return [b - a for a, b in zip(generated, generated[1:], strict=False)]


def generate_sample(model, tokenizer, prompt_ids: list[int], new_tokens: int) -> dict:
    """Greedy continuation of ``prompt_ids`` and decode speed, measured with a streamer's time stamps.

    After a warm-up call, one generate() call of exactly ``new_tokens`` tokens (EOS suppressed, batch 1): the prefill
    time is prompt -> first new token; decode tokens/s is (new_tokens - 1) / (first -> last new token), i.e. the
    per-token steps with the cache, prefill excluded.
    """
    model.eval()
    prompt = torch.tensor([prompt_ids], device=model.device)
    options = {"do_sample": False, "pad_token_id": tokenizer.pad_token_id, "attention_mask": torch.ones_like(prompt)}
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=2, min_new_tokens=2, **options)  # warm-up
        streamer = TokenClock()
        output = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=streamer,
                                **options)  # fmt: skip
    continuation = output[0, len(prompt_ids) :].tolist()
    gaps = streamer.token_gaps()
    return {
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(continuation),
        "prefill_seconds": streamer.stamps[1] - streamer.stamps[0],  # prompt handed out -> first new token
        "decode_tokens_per_second": len(gaps) / sum(gaps) if sum(gaps) > 0 else None,
        "threads": torch.get_num_threads(),
        "prompt_ids": list(prompt_ids),
        "continuation_ids": continuation,
        "prompt_tail": tokenizer.decode(prompt_ids[-64:]),
        "continuation": tokenizer.decode(continuation),
    }


def write_sample(out: Path, sample: dict, source: str) -> None:
    """sample.json (ids, text, timing) and sample.txt (the passage end and its continuation, for reading)."""
    (out / "sample.json").write_text(json.dumps({"source": source, **sample}, indent=2) + "\n")
    text = (
        f"Greedy continuation ({sample['new_tokens']} tokens) of a held-out passage ({source}, "
        f"{sample['prompt_tokens']} prompt tokens).\n\n--- end of the prompt ---\n{sample['prompt_tail']}\n"
        f"--- continuation ---\n{sample['continuation']}\n"
    )
    (out / "sample.txt").write_text(text)
