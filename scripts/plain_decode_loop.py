"""Plain greedy decode loop on SmolLM2-135M-Instruct: per contestant, one prefill of a ``--length``-token prompt
(``model(input_ids=..., cache=..., use_cache=True)``), then single-token steps, nothing around them (no
``generate``, no logits processors, no streamer). Contestants take turns in rounds (the benchmarks' decode timer,
:func:`zoo.bench.timer.take_turns`), so host noise falls on each alike: compare them inside one run only. The check
of ``zoo eval``'s speed rows and of the ``budget`` cache's decode cost (docs/guides/budget.md).

    flock -x /tmp/cpu.lock .venv/bin/python scripts/plain_decode_loop.py --length 8000 --new-tokens 32 \\
        --budget '{"policy": "snapkv", "fraction": 0.25}' --budget '{"policy": "sinks_recent", "tokens": 260, \\
        "sinks": 4, "recent": 256}'

``--budget JSON``: the ``budget`` variant's parameters (``fraction``: tokens = fraction x length); ``--variant
JSON``: ``{"variant": name, **params}`` of any zoo variant; the full cache (transformers' DynamicCache, SDPA) runs
first unless ``--no-full``. ``--profile N``: after the timing, N steps of each under torch.profiler, the top ops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from zoo.bench.passkey import build_prompt
from zoo.bench.timer import take_turns
from zoo.cache import cache_nbytes
from zoo.data.pretrained import smollm2
from zoo.plug.generation import make_cache
from zoo.plug.install import configure


def contestants(args: argparse.Namespace) -> dict[str, dict | None]:
    """name -> the ``{"variant": ..., **params}`` to configure (None: the full cache)."""
    chosen: dict[str, dict | None] = {} if args.no_full else {"full cache": None}
    for text in args.budget:
        params = json.loads(text)
        if "fraction" in params:
            params["tokens"] = max(params.get("sinks", 4) + params.get("recent", 64),
                                   int(params.pop("fraction") * args.length))
        chosen[f"budget {json.dumps(params, sort_keys=True)}"] = {"variant": "budget", **params}
    for text in args.variant:
        params = json.loads(text)
        chosen[json.dumps(params, sort_keys=True)] = params
    return chosen


def use(model, setting: dict | None) -> None:
    """Configure ``model`` for one contestant (every turn: the contestants share the one model)."""
    if setting is None:
        model.config._attn_implementation = "sdpa"
        model.set_attn_implementation("sdpa")
    else:
        params = dict(setting)
        configure(model, params.pop("variant"), **params)


def stepper(model, prompt: torch.Tensor, setting: dict | None, steps: int, state: dict):
    """The timer's (prefill, turn) of one contestant: greedy single-token steps, each timed alone."""

    def step() -> None:
        ids = state["token"]
        state["token"] = model(input_ids=ids, cache=state["cache"], use_cache=True).logits[:, -1:].argmax(-1)

    def prefill() -> dict:
        use(model, setting)
        state["cache"] = DynamicCache(config=model.config) if setting is None else make_cache(model)
        start = time.perf_counter()
        state["token"] = model(input_ids=prompt, cache=state["cache"], use_cache=True).logits[:, -1:].argmax(-1)
        state["tokens"] = [int(state["token"])]
        return {"prefill_s": time.perf_counter() - start}

    def turn() -> list[float]:
        use(model, setting)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            state["tokens"].append(int(state["token"]))
        return times

    return prefill, turn, step


def profile(name: str, step, steps: int, top: int) -> None:
    """``steps`` decode steps under torch.profiler: the ops that took the most time (self CPU), per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) / steps / 1e3
    print(f"\n== profile {name}: {total:.1f} ms of ops per step (self CPU, {steps} steps)")
    for event in rows[:top]:
        print(f"{event.key:<40} {event.self_cpu_time_total / steps / 1e3:8.2f} ms  {event.count // steps:6d} calls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8000, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="timed steps per contestant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", action="append", default=[], help="budget variant parameters (JSON)")
    parser.add_argument("--variant", action="append", default=[], help='{"variant": name, **params} (JSON)')
    parser.add_argument("--no-full", action="store_true", help="leave the full cache out")
    parser.add_argument("--profile", type=int, default=0, help="steps per contestant under torch.profiler")
    parser.add_argument("--top", type=int, default=25, help="ops listed per profile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = smollm2()
    prompt = torch.tensor([build_prompt(tokenizer, args.length, 0.5, 12345)])
    chosen = contestants(args)
    states = {name: {} for name in chosen}
    players = {name: stepper(model, prompt, setting, args.new_tokens, states[name]) for name, setting in chosen.items()}
    with torch.inference_mode():
        results = take_turns({name: p[:2] for name, p in players.items()}, args.rounds, catch=False)
        for name, setting in chosen.items():
            if args.profile:
                use(model, setting)
                profile(name, players[name][2], args.profile, args.top)
    first = next(iter(chosen))
    print(f"\nlength {args.length}, {args.new_tokens} steps x {args.rounds} rounds, {args.threads} threads")
    for name in chosen:
        gaps = results[name]["gaps"]
        line = {"name": name, "ms_per_token": round(1e3 * statistics.median(gaps), 2),
                "round_ms": [round(x, 2) for x in results[name]["round_ms"]],
                "prefill_s": round(results[name]["prefill_s"], 2), "cache_bytes": cache_nbytes(states[name]["cache"]),
                "first_tokens": states[name]["tokens"][:8]}
        if name != first:
            ratios = [a / b for a, b in zip(results[name]["round_ms"], results[first]["round_ms"], strict=True)]
            line[f"vs {first} (median of round ratios)"] = round(statistics.median(ratios), 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
