"""Perplexity by position on the held-out Gutenberg books (PG-19's way of asking whether a model uses far context:
the loss of late positions falls when it does). Each document is fed in chunks through the contestant's own cache,
so a bounded cache (``budget``, a window) evicts between chunks as it would while decoding; the full cache gives the
model's own loss. Losses are averaged per bucket of positions.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import torch

from zoo.data.gutenberg import LM_TEST_BOOKS, build_lm
from zoo.data.lm import spread_windows
from zoo.eval.contestants import cache_bytes, configure_for, fresh_cache


@functools.lru_cache(maxsize=4)
def _book_ids(tokenizer_key: str, tokenizer) -> tuple[list[int], ...]:
    texts = build_lm()["test"]["text"]
    return tuple(tokenizer(text, add_special_tokens=False).input_ids for text in texts)


def documents(tokenizer, length: int, count: int) -> list[list[int]]:
    """``count`` stretches of ``length`` tokens from the held-out books (:data:`~zoo.data.gutenberg.LM_TEST_BOOKS`),
    taken in turn from each book at evenly spaced offsets, never overlapping."""
    books = _book_ids(f"{tokenizer.name_or_path}:{len(tokenizer)}", tokenizer)
    return spread_windows(books, length, count, f"perplexity: a held-out book ({', '.join(LM_TEST_BOOKS)})",
                          "lower `documents` or `lengths`")


@torch.no_grad()
def token_losses(model, contestant: dict[str, Any], ids: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    """Per position (1..n-1) the next-token loss of ``ids`` (1, n) fed ``chunk`` tokens at a time through the
    contestant's cache; and the bytes that cache holds at the end."""
    kwargs = configure_for(model, contestant, ids.shape[1])
    cache = kwargs.get("cache") or fresh_cache(model, contestant)
    losses, previous = [], None
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start : start + chunk]
        logits = model(input_ids=piece, cache=cache, use_cache=True).logits.float()
        if previous is not None:
            losses.append(torch.nn.functional.cross_entropy(previous, piece[:, 0], reduction="none"))
        if piece.shape[1] > 1:
            losses.append(torch.nn.functional.cross_entropy(logits[0, :-1], piece[0, 1:], reduction="none"))
        previous = logits[:, -1]
    return torch.cat(losses), cache_bytes(cache, contestant)


def perplexity_row(model, tokenizer, contestant: dict[str, Any], length: int, count: int, bucket: int,
                   chunk: int) -> dict[str, Any]:
    """Mean loss and perplexity per bucket of ``bucket`` positions over ``count`` documents of ``length`` tokens."""
    start = time.perf_counter()
    totals = torch.zeros(math.ceil(length / bucket), dtype=torch.float64)
    counts = torch.zeros_like(totals)
    nbytes = 0
    for document in documents(tokenizer, length, count):
        losses, nbytes = token_losses(model, contestant, torch.tensor([document], device=model.device), chunk)
        where = torch.arange(1, length) // bucket  # loss i predicts position i + 1
        losses = losses.double().cpu()
        totals.index_add_(0, where, losses)
        counts.index_add_(0, where, torch.ones_like(losses, dtype=torch.float64))
    means = (totals / counts).tolist()
    return {"contestant": contestant["name"], "family": contestant["family"], "task": "perplexity",
            "length": length, "documents": count, "bucket": bucket, "chunk": chunk, "bucket_loss": means,
            "bucket_ppl": [math.exp(m) for m in means], "loss": float(totals.sum() / counts.sum()),
            "ppl": math.exp(float(totals.sum() / counts.sum())), "cache_bytes": nbytes,
            "seconds": time.perf_counter() - start}
