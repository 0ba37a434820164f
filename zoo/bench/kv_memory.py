"""Peak memory of the KV-cache benchmark (:mod:`zoo.bench.kv`): one fresh process per measurement (peak RSS is per
process) loads SmolLM2, configures one contestant of :data:`~zoo.bench.kv_contestants.MEMORY_ROWS` and generates,
while :class:`~zoo.bench.measure.RssSampler` follows the resident memory. Rows go to ``memory.jsonl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from zoo.bench.kv_contestants import MEMORY_ROWS, prepare
from zoo.bench.measure import RssSampler, rss_now
from zoo.bench.passkey import build_prompt
from zoo.bench.timer import TokenClock
from zoo.cache import cache_nbytes
from zoo.data.pretrained import smollm2
from zoo.reporting import max_rss_bytes


def measure_one(setting: dict) -> dict:
    """One fresh process: load SmolLM2, configure the contestant, one warm-up ``generate`` on a short prompt (one-off
    allocations: kernels' code pages, thread pools, oneDNN), then the measured ``generate``. RSS: after loading,
    before the measured call, the peak during the prefill (until the first token) and the decoding, and the process's
    ``ru_maxrss``."""
    torch.set_num_threads(setting.get("threads", 2))
    if setting.get("trim"):  # glibc: return freed heap memory to the system after every decoder layer
        import ctypes  # noqa: PLC0415

        trim = ctypes.CDLL("libc.so.6").malloc_trim
    model, tokenizer = smollm2()
    loaded_rss, loaded_peak = rss_now(), max_rss_bytes()
    context = setting["context"]
    ids = torch.tensor([build_prompt(tokenizer, context, 0.5, 12345)])
    contestant = dict(setting["contestant"])
    contestant["budget"] = setting["tokens"] / context if contestant["family"] in ("budget", "longformer") else 1.0
    kwargs = prepare(model, contestant, context, setting.get("chunk"))
    sampler = RssSampler()
    phases: dict[str, int] = {}

    def after_put(count: int) -> None:  # the second put: the prefill's token
        if count == 2:
            phases["prefill"] = sampler.mark()

    clock = TokenClock(after_put)
    layers = model.model.layers
    handles = [layer.register_forward_hook(sampler.hook) for layer in layers]
    if setting.get("trim"):
        handles += [layer.register_forward_hook(lambda *_: [trim(0)] and None) for layer in layers]
    with torch.no_grad():
        if setting.get("warmup", True):
            warm = torch.tensor([build_prompt(tokenizer, 256, 0.5, 12345)])
            model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False,
                           pad_token_id=tokenizer.eos_token_id, **prepare(model, dict(contestant), 256, None))
            kwargs = prepare(model, contestant, context, setting.get("chunk"))
        sampler.trace.clear()
        start_rss = rss_now()
        sampler.mark()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=setting["new_tokens"],
                             do_sample=False, pad_token_id=tokenizer.eos_token_id, return_dict_in_generate=True,
                             streamer=clock, **kwargs)
    phases["decode"] = sampler.mark()
    sampler.close()
    for handle in handles:
        handle.remove()
    gaps = sorted(1e3 * gap for gap in clock.token_gaps())
    trace = sampler.trace
    return {**setting, "tokens_kept": contestant.get("tokens"), "cache_bytes": cache_nbytes(out.past_key_values),
            "peak_rss_bytes": max_rss_bytes(), "model_rss_bytes": loaded_rss, "load_peak_rss_bytes": loaded_peak,
            "start_rss_bytes": start_rss, "prefill_peak_rss_bytes": phases.get("prefill"),
            "decode_peak_rss_bytes": phases.get("decode"), "end_rss_bytes": rss_now(),
            "layer_rss_mb": trace[:: max(1, len(trace) // 200)],
            "ms_per_token": gaps[len(gaps) // 2] if gaps else None}


def run_memory(out: Path, contexts: list[int], rows: list[str], *, tokens: int = 512, new_tokens: int = 16,
               chunk: int = 512, threads: int = 2, env: list[str] | None = None, trim: bool = False,
               warmup: bool = True, timeout: float = 1800) -> None:
    """Each of ``rows`` (names of :data:`MEMORY_ROWS`) at each context, every one in a fresh process
    (``python -m zoo.bench.kv _measure``, with ``env`` KEY=VALUE items added to its environment); rows appended to
    ``out/memory.jsonl``, a process that fails recorded with the end of its stderr."""
    path = out / "memory.jsonl"
    environment = dict(os.environ, **dict(item.split("=", 1) for item in env or []))
    for context in contexts:
        for name in rows:
            contestant, chunked = MEMORY_ROWS[name]
            setting = {"contestant": contestant, "chunk": chunk if chunked else None, "context": context,
                       "tokens": tokens, "new_tokens": new_tokens, "threads": threads, "env": env or [],
                       "trim": trim, "warmup": warmup}
            done = subprocess.run([sys.executable, "-m", "zoo.bench.kv", "_measure", json.dumps(setting)],
                                  capture_output=True, text=True, timeout=timeout, env=environment)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {**setting, "error": done.stderr[-500:]}
            with path.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps({k: (v if not k.endswith("bytes") or v is None else round(v / 2**20))
                              for k, v in row.items() if k not in ("layer_rss_mb", "new_tokens", "tokens")}),
                  flush=True)
