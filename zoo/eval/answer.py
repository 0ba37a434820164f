"""The answers of ``zoo eval``: for one task and length, every pending contestant's greedy answers to the samples,
batched, scored as RULER scores them (:mod:`zoo.eval.scoring`). Contestants whose prefill is the full model's (the
full cache, ``budget``, QuantizedCache) share one prefill per batch (:func:`zoo.bench.kv_accuracy.shared_generate`:
eviction happens after each layer's call, so it changes no prefill output); the others (a window, a variant, a saved
folder) prefill on their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from zoo.bench.kv_accuracy import shared_generate
from zoo.eval.contestants import as_kv_job, cache_bytes, configure_for, greedy, kept_fraction, shares_prefill
from zoo.eval.scoring import sample_score, summarize
from zoo.eval.tasks import Sample
from zoo.reporting import describe_error


def _batches(samples: list[Sample], size: int) -> list[list[Sample]]:
    """Batches of at most ``size`` samples (0: no limit) of one prompt length each (ids stack without padding; the
    zoo's own tasks have one length per cell, RULER's vary), in order of first appearance."""
    by_length: dict[int, list[Sample]] = {}
    for sample in samples:
        by_length.setdefault(len(sample.ids), []).append(sample)
    return [group[i : i + (size or len(group))] for group in by_length.values()
            for i in range(0, len(group), size or len(group))]


def _row(contestant: dict, samples: list[Sample], outputs: dict[int, str], nbytes: int, seconds: float,
         shared: bool) -> dict[str, Any]:
    """The row of one cell; ``outputs`` by sample index, written in the samples' order."""
    said = [outputs[s.index] for s in samples]
    scores = [sample_score(s, text) for s, text in zip(samples, said, strict=True)]
    first = samples[0]
    return {"contestant": contestant["name"], "family": contestant["family"],
            "kept": kept_fraction(contestant, first.length), "task": first.task, "length": first.length,
            "scoring": first.meta.get("scoring", "strict"), "indices": [s.index for s in samples],
            "depths": [s.depth for s in samples], "outputs": said, "scores": scores, **summarize(scores),
            "cache_bytes": nbytes // len(samples), "seconds": seconds, "shared_prefill": shared}


def answer_shared(model, tokenizer, samples: list[Sample], contestants: list[dict], batch: int) -> list[dict]:
    """Rows of ``contestants`` (all :func:`~zoo.eval.contestants.shares_prefill`) from one prefill per batch."""
    new_tokens = max(2, samples[0].new_tokens)
    outputs: list[dict[int, str]] = [{} for _ in contestants]
    nbytes = [0] * len(contestants)
    start = time.perf_counter()
    for part in _batches(samples, batch):
        length = len(part[0].ids)  # the prompt's; a budget keeps its share of it
        jobs = [as_kv_job(c, length) for c in contestants]
        ids = torch.tensor([s.ids for s in part], device=model.device)
        for index, (sequences, cache) in enumerate(shared_generate(model, ids, jobs, new_tokens=new_tokens,
                                                                   pad_token_id=tokenizer.eos_token_id,
                                                                   until_eos=True)):
            said = tokenizer.batch_decode(sequences[:, length:], skip_special_tokens=True)
            outputs[index].update(zip((s.index for s in part), said, strict=True))
            nbytes[index] += cache_bytes(cache, contestants[index])
            del cache
    seconds = time.perf_counter() - start
    return [_row(c, samples, said, total, seconds, True) for c, said, total in zip(contestants, outputs, nbytes,
                                                                                     strict=True)]


def answer_alone(model, tokenizer, samples: list[Sample], contestant: dict, batch: int) -> dict:
    """The row of one contestant from its own prefill (a window, a variant, a saved folder's model)."""
    outputs: dict[int, str] = {}
    nbytes = 0
    start = time.perf_counter()
    for part in _batches(samples, batch):
        kwargs = configure_for(model, contestant, len(part[0].ids))
        ids = torch.tensor([s.ids for s in part], device=model.device)
        new, cache = greedy(model, ids, max(2, part[0].new_tokens), tokenizer.eos_token_id, **kwargs)
        outputs.update(zip((s.index for s in part), tokenizer.batch_decode(new, skip_special_tokens=True),
                           strict=True))
        nbytes += cache_bytes(cache, contestant)
        del cache
    return _row(contestant, samples, outputs, nbytes, time.perf_counter() - start, False)


def answer_cell(model_for: Callable[[dict], tuple[Any, Any]], samples: list[Sample], contestants: list[dict],
                batch: int, write: Callable[[dict], None]) -> None:
    """Every contestant's row for one task and length, written as it is measured; a contestant that raises is
    written with its error and the others go on. ``model_for(contestant)`` gives (model, tokenizer)."""
    together = [c for c in contestants if shares_prefill(c)]
    if together:
        model, tokenizer = model_for(together[0])
        try:
            rows = answer_shared(model, tokenizer, samples, together, batch)
        except Exception as exc:  # recorded; the contestants of their own prefill still run
            rows = [_error_row(c, samples, exc) for c in together]
        for row in rows:
            write(row)
    for contestant in (c for c in contestants if not shares_prefill(c)):
        model, tokenizer = model_for(contestant)
        try:
            row = answer_alone(model, tokenizer, samples, contestant, batch)
        except Exception as exc:  # recorded; the run goes on
            row = _error_row(contestant, samples, exc)
        write(row)


def _error_row(contestant: dict, samples: list[Sample], exc: BaseException) -> dict:
    return {"contestant": contestant["name"], "family": contestant["family"], "task": samples[0].task,
            "length": samples[0].length, "error": describe_error(exc)}
