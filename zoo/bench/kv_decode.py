"""Decode time per token of the KV-cache benchmark (:mod:`zoo.bench.kv`), with the benchmarks' one decode timer
(:func:`zoo.bench.timer.take_turns`): on a tiny Llama (:func:`decode_tiny`) and on SmolLM2-135M
(:func:`decode_smollm2`). Rows go to ``decode.jsonl``.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import DynamicCache

from zoo.bench.kv_contestants import FULL, TOVA, TOVA_SLACK, WINDOW, prepare
from zoo.bench.passkey import build_prompt
from zoo.bench.timer import TokenClock, take_turns
from zoo.cache import cache_nbytes
from zoo.data.pretrained import smollm2
from zoo.plug.generation import make_cache


def _keeping(contestant: dict, tokens: int) -> dict:
    return {**contestant, "name": f"{contestant['name']} ({tokens} keys)"}


def _write(out: Path, row: dict, shown: dict) -> None:
    with (out / "decode.jsonl").open("a") as handle:
        handle.write(json.dumps(row) + "\n")
    print(json.dumps(shown), flush=True)


def _tiny_at(model, context: int, settings: list[dict], tokens: int, new_tokens: int, rounds: int,
             chunk: int | None) -> dict[str, dict]:
    """The timer's results of ``settings`` at ``context`` tokens, each turn one ``generate`` from the prompt."""
    ids = torch.randint(3, 512, (1, context), generator=torch.Generator().manual_seed(0))

    def turn(setting: dict) -> list[float]:
        kwargs = prepare(model, {**setting, "budget": tokens / context}, context, chunk)
        clock = TokenClock()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           streamer=clock, **kwargs)
        return clock.token_gaps()

    players = {s["name"]: (dict, partial(turn, s)) for s in settings}
    return take_turns(players, rounds, alternate=False, catch=False)


def decode_tiny(out: Path, contexts: list[int], *, tokens: int = 512, new_tokens: int = 16, rounds: int = 3,
                chunk: int | None = None, threads: int = 2) -> None:
    """Per-token decode time on a tiny Llama (hidden 256, 4 heads / 2 KV heads, 2 layers; the shape of
    ``zoo bench --decode``) after a prompt of each context: budget (``tokens`` keys) against the window cache
    keeping as many. Each turn is one ``generate`` from the prompt (its prefill untimed); the row's
    ``ms_per_token`` is the median over the turns' medians (``rounds``)."""
    torch.set_num_threads(threads)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    knorm = {**TOVA, "name": "budget knorm", "policy": "knorm"}
    settings = [_keeping(c, tokens) for c in (TOVA, TOVA_SLACK, knorm, WINDOW)]
    for context in contexts:
        for name, result in _tiny_at(model, context, settings, tokens, new_tokens, rounds, chunk).items():
            values = result["round_ms"]
            row = {"context": context, "name": name, "ms_per_token": sorted(values)[len(values) // 2],
                   "rounds": values, "threads": threads}
            _write(out, row, row)


def _smollm2_at(model, tokenizer, context: int, settings: list[dict], tokens: int, new_tokens: int, rounds: int,
                chunk: int | None) -> tuple[dict[str, dict], dict[str, dict]]:
    """The timer's results of ``settings`` after one prompt of ``context`` tokens, and each one's final state."""
    prompt = torch.tensor([build_prompt(tokenizer, context, 0.5, 12345)])
    state: dict[str, dict[str, Any]] = {}

    def generate(setting: dict, sequence: torch.Tensor, cache, count: int, chunked: bool, **options):
        kwargs = prepare(model, {**setting, "budget": tokens / context}, context, chunk if chunked else None)
        kwargs.pop("cache", None)
        with torch.no_grad():
            return model.generate(sequence, attention_mask=torch.ones_like(sequence), max_new_tokens=count,
                                  min_new_tokens=count, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                                  cache=cache, return_dict_in_generate=True, **kwargs, **options)

    def prefill(setting: dict) -> dict[str, Any]:  # once per contestant (timed, not compared)
        full = setting["family"] == "full"
        cache = DynamicCache() if full else make_cache(model)
        clock = TokenClock()
        state[setting["name"]] = {"sequence": generate(setting, prompt, cache, 1, not full, streamer=clock).sequences,
                                  "cache": cache}
        seconds = clock.stamps[-1] - clock.stamps[0]
        print(json.dumps({"prefilled": setting["name"], "seconds": seconds}), flush=True)
        return {"prefill_s": seconds}

    def turn(setting: dict) -> list[float]:
        here, clock = state[setting["name"]], TokenClock()
        here["sequence"] = generate(setting, here["sequence"], here["cache"], new_tokens, False,
                                    streamer=clock).sequences
        return clock.token_gaps()

    players = {s["name"]: (partial(prefill, s), partial(turn, s)) for s in settings}
    return take_turns(players, rounds, alternate=False, catch=False), state


def decode_smollm2(out: Path, contexts: list[int], *, tokens: int = 512, new_tokens: int = 16, rounds: int = 3,
                   chunk: int | None = None, threads: int = 2) -> None:
    """Per-token decode time on SmolLM2-135M after a prompt of each context: budget ``tova`` (``tokens`` keys, and
    with ``slack=64``), the ``longformer`` window + 4 sinks keeping as many, and transformers' full cache. Each
    contestant prefills once (chunked by ``chunk``; the full cache unchunked); then ``rounds`` rounds, each
    contestant in turn continuing its own generation by ``new_tokens`` tokens through ``generate`` (its cache
    passed back in), so that load drifts hit every contestant alike."""
    torch.set_num_threads(threads)
    model, tokenizer = smollm2()
    settings = [*(_keeping(c, tokens) for c in (TOVA, TOVA_SLACK, WINDOW)), FULL]
    for context in contexts:
        if context + rounds * new_tokens + 1 > model.config.max_position_embeddings:
            raise SystemExit(f"context {context} + {rounds} x {new_tokens} tokens passes the model's "
                             f"{model.config.max_position_embeddings} positions")
        results, state = _smollm2_at(model, tokenizer, context, settings, tokens, new_tokens, rounds, chunk)
        reference = sorted(results[settings[2]["name"]]["gaps"])
        for name, result in results.items():
            values = sorted(result["gaps"])
            row = {"model": "smollm2-135m", "context": context, "name": name,
                   "ms_per_token": 1e3 * values[len(values) // 2], "tokens_timed": len(values),
                   "ms_per_token_all": [1e3 * gap for gap in result["gaps"]], "prefill_s": result["prefill_s"],
                   "threads": threads, "chunk": chunk, "rounds": rounds,
                   "cache_bytes": cache_nbytes(state[name]["cache"]),
                   "vs_window": values[len(values) // 2] / reference[len(reference) // 2],
                   "load": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None}
            _write(out, row, {k: v for k, v in row.items() if k != "ms_per_token_all"})
