"""Speed and memory of each ``zoo eval`` contestant, each in a fresh process (peak RSS is per process): load the
model, configure the contestant, one warm-up ``generate`` on a short prompt, then one prompt of ``length`` tokens:
the prefill (``generate`` of one token, timed), then ``rounds`` turns continuing the same sequence and cache by
``new_tokens`` tokens each (the benchmarks' decode timer, :func:`zoo.bench.timer.take_turns`); ms per token is the
median of every token gap. Cache bytes after the last turn; the process's peak RSS.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import torch

from zoo.bench.passkey import build_prompt
from zoo.bench.timer import TokenClock, take_turns
from zoo.eval.contestants import cache_bytes, configure_for, fresh_cache, load_model
from zoo.reporting import describe_error, peak_rss_bytes, reset_peak_rss


def measure(setting: dict[str, Any]) -> dict[str, Any]:
    """One contestant's speed row (run in the process that measures it)."""
    reset_peak_rss()
    torch.set_num_threads(setting.get("threads", 2))
    contestant, length = setting["contestant"], setting["length"]
    model, tokenizer = load_model(contestant.get("path", setting["model"]), setting.get("device"),
                                  setting.get("dtype"))
    pad = tokenizer.eos_token_id
    state: dict[str, Any] = {}

    def generate(sequence: torch.Tensor, count: int, **options) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(sequence, attention_mask=torch.ones_like(sequence), max_new_tokens=count,
                                  min_new_tokens=count, do_sample=False, pad_token_id=pad, cache=state["cache"],
                                  **options)

    def prefill() -> dict[str, Any]:
        warm = torch.tensor([build_prompt(tokenizer, 256, 0.5, 12345)], device=model.device)
        kwargs = configure_for(model, contestant, 256)
        state["cache"] = kwargs.pop("cache", None) or fresh_cache(model, contestant)
        generate(warm, 4)
        kwargs = configure_for(model, contestant, length)
        state["cache"] = kwargs.pop("cache", None) or fresh_cache(model, contestant)
        prompt = torch.tensor([build_prompt(tokenizer, length, 0.5, 12345)], device=model.device)
        start = time.perf_counter()
        state["sequence"] = generate(prompt, 1, **kwargs)
        return {"prefill_s": time.perf_counter() - start}

    def turn() -> list[float]:
        clock = TokenClock()
        state["sequence"] = generate(state["sequence"], setting["new_tokens"], streamer=clock)
        return clock.token_gaps()

    result = take_turns({contestant["name"]: (prefill, turn)}, setting["rounds"], catch=False)[contestant["name"]]
    gaps = sorted(result["gaps"])
    return {"contestant": contestant["name"], "family": contestant["family"], "length": length,
            "prefill_s": result["prefill_s"], "ms_per_token": 1e3 * gaps[len(gaps) // 2],
            "round_ms": result["round_ms"], "tokens_timed": len(gaps),
            "cache_bytes": cache_bytes(state["cache"], contestant), "peak_rss_bytes": peak_rss_bytes(),
            "threads": setting.get("threads", 2)}


def measure_in_process(setting: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """:func:`measure` in a fresh ``python -m zoo.eval _speed`` process; a failure becomes a row with its error."""
    try:
        done = subprocess.run([sys.executable, "-m", "zoo.eval", "_speed", json.dumps(setting)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return {"contestant": setting["contestant"]["name"], "length": setting["length"],
                "error": describe_error(exc)}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"contestant": setting["contestant"]["name"], "length": setting["length"],
            "error": done.stderr.strip()[-600:] or f"exit {done.returncode}"}
