"""The accuracy table of the KV-cache benchmark (:mod:`zoo.bench.kv`): each contestant's greedy answers to the
passkey prompts of one context, batched, by its own ``generate`` (:func:`run_contestant`) or after one prefill
shared by every contestant that cannot change the prefill (:func:`run_shared`). Rows go to ``accuracy.jsonl`` as
they finish (an interrupted run keeps what it measured).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, QuantizedCache

from zoo.bench.kv_contestants import RECENT, SINKS, held_bytes, prepare, quantized_bytes
from zoo.bench.passkey import NEW_TOKENS, found, load_prompts
from zoo.cache.policies import DEFAULT_QUERY_WINDOW, as_policy
from zoo.data.pretrained import smollm2
from zoo.plug.generation import make_cache
from zoo.plug.install import configure
from zoo.registry import get_policy_class


def run_contestant(model, tokenizer, prompts: list[dict], contestant: dict, chunk: int | None = None) -> dict:
    """The accuracy row of ``contestant`` on ``prompts`` (one context, one batch) from its own ``generate``."""
    context = prompts[0]["context"]
    kwargs = prepare(model, contestant, context, chunk)
    ids = torch.tensor([row["ids"] for row in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id, return_dict_in_generate=True, **kwargs)
    seconds = time.perf_counter() - start
    answers = tokenizer.batch_decode(out.sequences[:, ids.shape[1]:])
    seen = ids.shape[1] + NEW_TOKENS - 1
    nbytes = held_bytes(out.past_key_values, contestant["family"])
    if contestant["family"] == "quantized":
        contestant["estimated_bytes"] = quantized_bytes(model.config, seen, contestant["nbits"], RECENT,
                                                        len(prompts)) // len(prompts)
    return {**contestant, "context": context, "per_prompt_bytes": nbytes // len(prompts),
            "found": found(prompts, answers), "depths": [row["depth"] for row in prompts], "answers": answers,
            "seconds": seconds, "chunk": chunk}


# ------------------------------------------------------------------------------------------------------
# one prefill shared by every contestant whose prefill is the full model's


def _job_cache(model, source, job: dict, context: int):
    """The cache ``job`` would hold after its own prefill, built from ``source`` (a budget cache that evicted
    nothing): eviction changes no prefill output (a layer evicts after its own attention call, and while nothing was
    evicted the call is ``inner``'s), so the kept keys are the ones the job's own ``observe`` would keep."""
    family = job["family"]
    if family == "budget":
        prepare(model, job, context)
        cache = make_cache(model)
        for layer, held in zip(cache.layers, source.layers, strict=True):
            own = {name: getattr(layer, name) for name in ("tokens", "sinks", "recent", "policy", "slack", "window")}
            layer.__dict__.update(vars(held))
            layer.__dict__.update(own)
            if not layer.records_queries:  # what the recording prefill kept for the others
                layer.queries = layer.query_real = None
            elif layer.queries is not None:
                layer.queries, layer.query_real = layer.queries[..., -layer.window :, :], \
                    layer.query_real[:, -layer.window :]
            if layer.keys.shape[-2] > layer.tokens + layer.slack:
                layer.evict()
        return cache
    if family == "quantized":
        cache = QuantizedCache(backend="quanto", config=model.config, nbits=job["nbits"], residual_length=RECENT)
    elif family == "full":
        cache = DynamicCache()
    else:
        raise ValueError(f"no shared prefill for family {family!r}")
    for index, held in enumerate(source.layers):  # the update a prefill call makes
        cache.update(held.keys, held.values, index)
    return cache


def shared_generate(model, ids: torch.Tensor, jobs: list[dict], new_tokens: int = NEW_TOKENS,
                    pad_token_id: int = 0, until_eos: bool = False) -> list[tuple[torch.Tensor, Any]]:
    """Greedy ``new_tokens`` tokens of every job (contestant dicts of the families full, quantized, budget) after
    one prefill per kind of prefill (the full model's; ``h2o``'s, which computes its attention mass): the first token
    from that prefill, the rest through ``generate`` continuing from the job's cache (``until_eos``: stopping once every
row has ended its answer, else exactly ``new_tokens``). Returns (sequences, cache)."""
    context = ids.shape[1]
    results: list[Any] = [None] * len(jobs)
    policies = {i: as_policy(job["policy"], get_policy_class) for i, job in enumerate(jobs) if job.get("policy")}
    for accumulates in (False, True):
        mine = [i for i in range(len(jobs)) if (i in policies and policies[i].accumulates) == accumulates]
        if not mine:
            continue
        window = max([DEFAULT_QUERY_WINDOW] + [policies[i].recorded_window for i in mine if i in policies])
        configure(model, "budget", tokens=context + new_tokens, sinks=SINKS, recent=RECENT,
                  policy="h2o" if accumulates else {"name": "snapkv", "window": window})
        source = make_cache(model)
        with torch.no_grad():
            first = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                   pad_token_id=pad_token_id, cache=source)
        for i in mine:
            job = dict(jobs[i])
            cache = _job_cache(model, source, job, context)
            kwargs = prepare(model, job, context)
            kwargs.pop("cache", None)
            with torch.no_grad():
                out = model.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=new_tokens - 1,
                                     min_new_tokens=None if until_eos else new_tokens - 1, do_sample=False,
                                     pad_token_id=pad_token_id,
                                     cache=cache, **kwargs)
            results[i] = (out, cache)
        del source
    return results


def run_shared(model, tokenizer, prompts: list[dict], jobs: list[dict], batch: int = 0) -> list[dict]:
    """Accuracy rows (as :func:`run_contestant`'s) of ``jobs`` from shared prefills, ``batch`` prompts at a time."""
    context, size = prompts[0]["context"], batch or len(prompts)
    ids = torch.tensor([row["ids"] for row in prompts])
    start = time.perf_counter()
    answers: list[list[str]] = [[] for _ in jobs]
    nbytes = [0] * len(jobs)
    for first in range(0, len(prompts), size):
        part = ids[first : first + size]
        for index, (out, cache) in enumerate(shared_generate(model, part, jobs, pad_token_id=tokenizer.eos_token_id)):
            answers[index] += tokenizer.batch_decode(out[:, context:])
            nbytes[index] += held_bytes(cache, jobs[index]["family"])
    seconds = time.perf_counter() - start
    rows = []
    for job, said, total in zip(jobs, answers, nbytes, strict=True):
        job = dict(job)
        prepare(model, job, context)
        if job["family"] == "quantized":
            job["estimated_bytes"] = quantized_bytes(model.config, context + NEW_TOKENS - 1, job["nbits"], RECENT, 1)
        rows.append({**job, "context": context, "per_prompt_bytes": total // len(prompts),
                     "found": found(prompts, said), "depths": [row["depth"] for row in prompts], "answers": said,
                     "chunk": None, "shared_prefill": True, "seconds_all_jobs": seconds})
    return rows


def run_accuracy(out: Path, contexts: list[int], chosen: list[dict], *, shared: bool = False, batch: int = 0,
                 keys_per_depth: int = 0, chunk: int | None = None, threads: int = 2) -> None:
    """Accuracy rows of the ``chosen`` contestants at each context, appended to ``out/accuracy.jsonl``; ``shared``:
    every family but longformer (its window changes the prefill) from shared prefills. A contestant that raises is
    recorded with its error and the run goes on."""
    torch.set_num_threads(threads)
    model, tokenizer = smollm2()
    path = out / "accuracy.jsonl"

    def write(row: dict) -> None:
        with path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps({k: row.get(k) for k in ("name", "budget", "context", "found", "seconds", "error")}),
              flush=True)

    for context in contexts:
        prompts = load_prompts(out, context, keys_per_depth)
        todo = [dict(c) for c in chosen]
        if shared:
            together = [c for c in todo if c["family"] != "longformer"]
            if together:
                for row in run_shared(model, tokenizer, prompts, together, batch):
                    write(row)
            todo = [c for c in todo if c["family"] == "longformer"]
        for contestant in todo:
            try:
                row = run_contestant(model, tokenizer, prompts, contestant, chunk)
            except Exception as exc:  # recorded, the run goes on
                row = {**contestant, "context": context, "error": f"{type(exc).__name__}: {exc}"}
            write(row)

