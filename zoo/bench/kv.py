"""Passkey retrieval on a real pretrained model (SmolLM2-135M-Instruct, :mod:`zoo.data.pretrained`) with a bounded KV
cache: the ``budget`` variant under each policy, against transformers' full cache, the zoo ``longformer`` window with
4 sinks, transformers' ``QuantizedCache`` (quanto) and, from a second environment, NVIDIA kvpress
(scripts/kvpress_peer.py, reading the prompts this module writes).

    python -m zoo.bench.kv prompts  --contexts 1024 2048 --depths 0.1 0.5 0.9 --keys 2 --out docs/bench/kv
    python -m zoo.bench.kv accuracy --contexts 1024 --budgets 0.5 0.25 0.1 --out docs/bench/kv
    python -m zoo.bench.kv memory   --contexts 2048 8192 --tokens 512 --out docs/bench/kv  # RSS, bytes, ms/token
    python -m zoo.bench.kv report   --out docs/bench/kv                                   # kv.md and kv.png

A prompt is a 5-digit key hidden at a depth of repeated filler, asked for at the end; it is found when the greedy
continuation (8 tokens) contains the key. Prompts of one context length have the same token count, so they run as one
batch. Rows go to ``accuracy.jsonl`` / ``memory.jsonl`` as they finish (an interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import DynamicCache, QuantizedCache

from zoo.cache import POLICIES, cache_nbytes
from zoo.data.pretrained import smollm2
from zoo.plug.generation import make_cache
from zoo.plug.install import configure
from zoo.reporting import max_rss_bytes

HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you "
          "about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
NEW_TOKENS = 8
SINKS, RECENT = 4, 64


def build_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Exactly ``length`` token ids: header, filler with the needle at ``depth`` of it, the question."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    head, needle, question, filler = ids(HEADER), ids(NEEDLE.format(key=key)), ids(QUESTION), ids(FILLER)
    room = length - len(head) - len(needle) - len(question)
    body = (filler * (room // len(filler) + 1))[:room]
    cut = int(depth * room)
    return head + body[:cut] + needle + body[cut:] + question


def write_prompts(out: Path, contexts: list[int], depths: list[float], keys: int, seed: int = 0) -> Path:
    """Write ``keys`` prompts per context and depth to ``prompts.json``, replacing that file's prompts of these
    contexts only (the others, and the rows measured on them, stay valid). Keys drawn from ``seed + context``."""
    _, tokenizer = smollm2()
    path = out / "prompts.json"
    rows = [row for row in json.loads(path.read_text()) if row["context"] not in contexts] if path.exists() else []
    for context in contexts:
        rng = random.Random(seed + context)
        rows += [{"context": context, "depth": d, "key": rng.randrange(10000, 100000)} for d in depths
                 for _ in range(keys)]
    for row in rows:
        row.setdefault("ids", build_prompt(tokenizer, row["context"], row["depth"], row["key"]))
    path.write_text(json.dumps(rows))
    return path


def load_prompts(out: Path, context: int) -> list[dict]:
    return [row for row in json.loads((out / "prompts.json").read_text()) if row["context"] == context]


# ------------------------------------------------------------------------------------------------------
# contestants: (name, family, setting, kept fraction) -> configured model + generate kwargs


def contestants(budgets: list[float], policies: list[str], quantized: bool = True) -> list[dict]:
    rows = [{"name": "full cache (transformers)", "family": "full", "budget": 1.0}]
    for fraction in budgets:
        rows += [{"name": f"budget {policy}", "family": "budget", "policy": policy, "budget": fraction}
                 for policy in policies]
        rows.append({"name": "longformer window + 4 sinks", "family": "longformer", "budget": fraction})
    if quantized:
        rows += [{"name": f"QuantizedCache quanto {bits}-bit", "family": "quantized", "nbits": bits,
                  "budget": bits / 32} for bits in (4, 2)]
    return rows


def prepare(model, contestant: dict, context: int, chunk: int | None = None) -> dict[str, Any]:
    """Configure ``model`` for ``contestant`` at ``context`` tokens; returns extra generate kwargs."""
    family, kept = contestant["family"], max(SINKS + RECENT, int(contestant["budget"] * context))
    kwargs: dict[str, Any] = {}
    if chunk:
        kwargs["prefill_chunk_size"] = chunk
    if family in ("full", "quantized"):
        model.config._attn_implementation = "sdpa"
        model.set_attn_implementation("sdpa")
        if family == "quantized":
            kwargs["cache"] = QuantizedCache(backend="quanto", config=model.config, nbits=contestant["nbits"],
                                             residual_length=RECENT)
    elif family == "budget":
        configure(model, "budget", tokens=kept, sinks=SINKS, recent=RECENT, policy=contestant["policy"],
                  slack=contestant.get("slack", 0))
    elif family == "longformer":
        configure(model, "longformer", window=2 * (kept - SINKS), global_tokens=list(range(SINKS)))
    contestant["tokens"] = kept if family in ("budget", "longformer") else None
    return kwargs


def quantized_bytes(config, seen: int, nbits: int, residual: int, batch: int, group: int = 64) -> int:
    """Estimated bytes of a QuantizedCache: nbits per value plus an fp32 scale and zero point per group of ``group``
    values for the quantized tokens, fp32 for the residual ones (quanto's tensors are not plain storages)."""
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    per_token = 2 * heads * dim * config.num_hidden_layers * batch  # values of k and v
    quantized = max(0, seen - residual)
    return int(quantized * per_token * (nbits / 8 + 8 / group) + min(seen, residual) * per_token * 4)


def stored_bytes(tensor: Any) -> int:
    """Bytes of a tensor, of a tensor subclass (quanto's packed QBitsTensor) its inner tensors', recursively."""
    if not isinstance(tensor, torch.Tensor):
        return 0
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None and type(tensor) is not torch.Tensor:
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def quantized_cache_bytes(cache) -> int:
    """What a QuantizedCache holds: the quantized keys and values (packed data, scales, zero points) and the
    full-precision residual tokens."""
    return sum(stored_bytes(getattr(layer, name, None)) for layer in cache.layers
               for name in ("_quantized_keys", "_quantized_values", "keys", "values"))


def run_contestant(model, tokenizer, prompts: list[dict], contestant: dict, chunk: int | None = None) -> dict:
    context = prompts[0]["context"]
    kwargs = prepare(model, contestant, context, chunk)
    ids = torch.tensor([row["ids"] for row in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id, return_dict_in_generate=True, **kwargs)
    seconds = time.perf_counter() - start
    answers = tokenizer.batch_decode(out.sequences[:, ids.shape[1]:])
    found = [str(row["key"]) in answer for row, answer in zip(prompts, answers, strict=True)]
    seen = ids.shape[1] + NEW_TOKENS - 1
    if contestant["family"] == "quantized":
        nbytes = quantized_cache_bytes(out.past_key_values)
        contestant["estimated_bytes"] = quantized_bytes(model.config, seen, contestant["nbits"], RECENT,
                                                        len(prompts)) // len(prompts)
    else:
        nbytes = cache_nbytes(out.past_key_values)
    return {**{k: v for k, v in contestant.items()}, "context": context, "per_prompt_bytes": nbytes // len(prompts),
            "found": found, "depths": [row["depth"] for row in prompts], "answers": answers, "seconds": seconds,
            "chunk": chunk}


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
                    pad_token_id: int = 0) -> list[tuple[torch.Tensor, Any]]:
    """Greedy ``new_tokens`` tokens of every job (contestant dicts of the families full, quantized, budget) after
    one prefill per kind of prefill (the full model's; ``h2o``'s, which computes its attention mass): the first token
    from that prefill, the rest through ``generate`` continuing from the job's cache. Returns (sequences, cache)."""
    context = ids.shape[1]
    results: list[Any] = [None] * len(jobs)
    for accumulates in (False, True):
        mine = [i for i, job in enumerate(jobs) if (job.get("policy") == "h2o") == accumulates]
        if not mine:
            continue
        record = {"name": "shared prefill", "family": "budget", "policy": "h2o" if accumulates else "snapkv",
                  "budget": 1.0, "tokens": context + new_tokens}
        configure(model, "budget", tokens=context + new_tokens, sinks=SINKS, recent=RECENT, policy=record["policy"],
                  window=32)
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
                                     min_new_tokens=new_tokens - 1, do_sample=False, pad_token_id=pad_token_id,
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
            job = jobs[index]
            nbytes[index] += quantized_cache_bytes(cache) if job["family"] == "quantized" else cache_nbytes(cache)
    seconds = time.perf_counter() - start
    rows = []
    for job, said, total in zip(jobs, answers, nbytes, strict=True):
        job = dict(job)
        prepare(model, job, context)
        if job["family"] == "quantized":
            job["estimated_bytes"] = quantized_bytes(model.config, context + NEW_TOKENS - 1, job["nbits"], RECENT, 1)
        rows.append({**job, "context": context, "per_prompt_bytes": total // len(prompts),
                     "found": [str(row["key"]) in answer for row, answer in zip(prompts, said, strict=True)],
                     "depths": [row["depth"] for row in prompts], "answers": said, "chunk": None,
                     "shared_prefill": True, "seconds_all_jobs": seconds})
    return rows


def cmd_accuracy(args) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = smollm2()
    path = args.out / "accuracy.jsonl"

    def write(row: dict) -> None:
        with path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps({k: row.get(k) for k in ("name", "budget", "context", "found", "seconds", "error")}),
              flush=True)

    for context in args.contexts:
        prompts = load_prompts(args.out, context)
        if args.keys_per_depth:
            prompts = [row for depth in sorted({r["depth"] for r in prompts})
                       for row in [r for r in prompts if r["depth"] == depth][: args.keys_per_depth]]
        chosen = [dict(c) for c in contestants(args.budgets, args.policies, quantized=not args.no_quantized)
                  if not args.only or c["family"] in args.only]
        if args.shared:  # every family but longformer (its window changes the prefill) from shared prefills
            shared = [c for c in chosen if c["family"] != "longformer"]
            if shared:
                for row in run_shared(model, tokenizer, prompts, shared, args.batch):
                    write(row)
            chosen = [c for c in chosen if c["family"] == "longformer"]
        for contestant in chosen:
            try:
                row = run_contestant(model, tokenizer, prompts, contestant, args.chunk)
            except Exception as exc:  # recorded, the run goes on
                row = {**contestant, "context": context, "error": f"{type(exc).__name__}: {exc}"}
            write(row)


# ------------------------------------------------------------------------------------------------------
# memory and decode time: one fresh process per measurement (peak RSS is per process)


PAGE = 4096


def rss_now() -> int:
    """Current resident memory of this process (``/proc/self/statm``; 0 where there is none)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE
    except OSError:
        return 0


class RssSampler:
    """A thread that reads the current RSS every ``interval`` seconds: the peak since :meth:`mark` and, per decoder
    layer call (``hook``), the RSS after it, so the trace shows where (which chunk, which layer) memory grows."""

    def __init__(self, interval: float = 0.002) -> None:
        import threading  # noqa: PLC0415

        self.interval, self.peak, self.stop = interval, rss_now(), threading.Event()
        self.trace: list[tuple[int, int]] = []  # (layer index, RSS MB after its call)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_now())
            time.sleep(self.interval)

    def mark(self) -> int:
        """The peak since the last mark (and reset it to the current RSS)."""
        peak, self.peak = max(self.peak, rss_now()), rss_now()
        return peak

    def hook(self, module, args, output) -> None:
        self.peak = max(self.peak, rss_now())
        self.trace.append((module.self_attn.layer_idx, rss_now() // 2**20))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class TimeStamps:
    """A ``generate`` streamer: the time of every ``put`` (the prompt, then each new token), ``on_put(count)`` after
    each. :meth:`gaps_ms`: the decoding steps' times (the prompt and the prefill's token skipped)."""

    def __init__(self, on_put=None) -> None:
        self.stamps: list[float] = []
        self.on_put = on_put

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())
        if self.on_put is not None:
            self.on_put(len(self.stamps))

    def end(self) -> None:
        pass

    def gaps_ms(self) -> list[float]:
        return [1000 * (b - a) for a, b in zip(self.stamps[2:], self.stamps[3:], strict=False)]


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

    stamps = TimeStamps(after_put)
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
                             streamer=stamps, **kwargs)
    phases["decode"] = sampler.mark()
    sampler.close()
    for handle in handles:
        handle.remove()
    gaps = sorted(stamps.gaps_ms())
    trace = sampler.trace
    return {**setting, "tokens_kept": contestant.get("tokens"), "cache_bytes": cache_nbytes(out.past_key_values),
            "peak_rss_bytes": max_rss_bytes(), "model_rss_bytes": loaded_rss, "load_peak_rss_bytes": loaded_peak,
            "start_rss_bytes": start_rss, "prefill_peak_rss_bytes": phases.get("prefill"),
            "decode_peak_rss_bytes": phases.get("decode"), "end_rss_bytes": rss_now(),
            "layer_rss_mb": trace[:: max(1, len(trace) // 200)],
            "ms_per_token": gaps[len(gaps) // 2] if gaps else None}


MEMORY_ROWS = {  # name -> (contestant, chunked prefill)
    "full": ({"name": "full cache (transformers)", "family": "full"}, False),
    "full-chunked": ({"name": "full cache (transformers)", "family": "full"}, True),
    "budget": ({"name": "budget tova", "family": "budget", "policy": "tova"}, False),
    "budget-chunked": ({"name": "budget tova", "family": "budget", "policy": "tova"}, True),
    "budget-slack-chunked": ({"name": "budget tova slack 64", "family": "budget", "policy": "tova", "slack": 64},
                             True),
    "window-chunked": ({"name": "longformer window + 4 sinks", "family": "longformer"}, True),
}


def cmd_memory(args) -> None:
    import os  # noqa: PLC0415

    path = args.out / "memory.jsonl"
    env = dict(os.environ, **dict(item.split("=", 1) for item in args.env or []))
    for context in args.contexts:
        for name in args.rows:
            contestant, chunked = MEMORY_ROWS[name]
            setting = {"contestant": contestant, "chunk": args.chunk if chunked else None, "context": context,
                       "tokens": args.tokens, "new_tokens": args.new_tokens, "threads": args.threads,
                       "env": args.env or [], "trim": args.trim, "warmup": not args.no_warmup}
            done = subprocess.run([sys.executable, "-m", "zoo.bench.kv", "_measure", json.dumps(setting)],
                                  capture_output=True, text=True, timeout=args.timeout, env=env)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {**setting, "error": done.stderr[-500:]}
            with path.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps({k: (v if not k.endswith("bytes") or v is None else round(v / 2**20))
                              for k, v in row.items() if k not in ("layer_rss_mb", "new_tokens", "tokens")}),
                  flush=True)


def cmd_decode(args) -> None:
    """Per-token decode time on a tiny Llama (hidden 256, 4 heads / 2 KV heads, 2 layers; the shape of
    ``zoo bench --decode``) after a prompt of each context: budget (``--tokens`` keys) against the window cache
    keeping as many, in one process, rounds alternating so that load drifts hit every contestant alike."""
    torch.set_num_threads(args.threads)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    settings = [
        {"name": f"budget tova ({args.tokens} keys)", "family": "budget", "policy": "tova"},
        {"name": f"budget tova slack 64 ({args.tokens} keys)", "family": "budget", "policy": "tova", "slack": 64},
        {"name": f"budget knorm ({args.tokens} keys)", "family": "budget", "policy": "knorm"},
        {"name": f"longformer window + 4 sinks ({args.tokens} keys)", "family": "longformer"},
    ]
    times: dict[str, list[float]] = {s["name"]: [] for s in settings}
    for context in args.contexts:
        ids = torch.randint(3, 512, (1, context), generator=torch.Generator().manual_seed(0))
        for _ in range(args.rounds):
            for setting in settings:
                contestant = {**setting, "budget": args.tokens / context}
                kwargs = prepare(model, contestant, context, args.chunk)
                stamps = TimeStamps()
                with torch.no_grad():
                    model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                   do_sample=False, streamer=stamps, **kwargs)
                gaps = sorted(stamps.gaps_ms())
                times[setting["name"]].append(gaps[len(gaps) // 2])
        for name, values in times.items():
            row = {"context": context, "name": name, "ms_per_token": sorted(values)[len(values) // 2],
                   "rounds": values, "threads": args.threads}
            with (args.out / "decode.jsonl").open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
            values.clear()


def cmd_decode_smollm2(args) -> None:
    """Per-token decode time on SmolLM2-135M after a prompt of each context: budget ``tova`` (``--tokens`` keys, and
    with ``slack=64``), the ``longformer`` window + 4 sinks keeping as many, and transformers' full cache. Each
    contestant prefills once (chunked by ``--chunk``; the full cache unchunked); then ``--rounds`` rounds, each
    contestant in turn continuing its own generation by ``--new_tokens`` tokens through ``generate`` (its cache
    passed back in), so that load drifts hit every contestant alike. A token's time is the gap between streamer
    time stamps (the first two of each call, the prompt and the one-token prefill, are skipped)."""
    torch.set_num_threads(args.threads)
    model, tokenizer = smollm2()
    settings = [
        {"name": f"budget tova ({args.tokens} keys)", "family": "budget", "policy": "tova"},
        {"name": f"budget tova slack 64 ({args.tokens} keys)", "family": "budget", "policy": "tova", "slack": 64},
        {"name": f"longformer window + 4 sinks ({args.tokens} keys)", "family": "longformer"},
        {"name": "full cache (transformers)", "family": "full"},
    ]
    for context in args.contexts:
        if context + args.rounds * args.new_tokens + 1 > model.config.max_position_embeddings:
            raise SystemExit(f"context {context} + {args.rounds} x {args.new_tokens} tokens passes the model's "
                             f"{model.config.max_position_embeddings} positions")
        prompt = torch.tensor([build_prompt(tokenizer, context, 0.5, 12345)])
        state = {}
        for setting in settings:  # the prefill, once per contestant (timed, not compared)
            contestant = {**setting, "budget": args.tokens / context}
            kwargs = prepare(model, contestant, context, None if setting["family"] == "full" else args.chunk)
            cache = DynamicCache() if setting["family"] == "full" else make_cache(model)
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1,
                                     do_sample=False, pad_token_id=tokenizer.eos_token_id, cache=cache,
                                     return_dict_in_generate=True, **kwargs)
            state[setting["name"]] = {"sequence": out.sequences, "cache": cache, "times": [],
                                      "prefill_s": time.perf_counter() - start}
            print(json.dumps({"prefilled": setting["name"], "seconds": state[setting["name"]]["prefill_s"]}),
                  flush=True)
        for _ in range(args.rounds):
            for setting in settings:
                here = state[setting["name"]]
                contestant = {**setting, "budget": args.tokens / context}
                kwargs = prepare(model, contestant, context, None)
                kwargs.pop("cache", None)
                stamps = TimeStamps()
                sequence = here["sequence"]
                with torch.no_grad():
                    out = model.generate(sequence, attention_mask=torch.ones_like(sequence),
                                         max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                         do_sample=False, pad_token_id=tokenizer.eos_token_id, cache=here["cache"],
                                         streamer=stamps, return_dict_in_generate=True, **kwargs)
                here["sequence"] = out.sequences
                here["times"] += stamps.gaps_ms()
        reference = state[settings[2]["name"]]["times"]
        for setting in settings:
            here = state[setting["name"]]
            values = sorted(here["times"])
            row = {"model": "smollm2-135m", "context": context, "name": setting["name"],
                   "ms_per_token": values[len(values) // 2], "tokens_timed": len(values),
                   "ms_per_token_all": here["times"], "prefill_s": here["prefill_s"], "threads": args.threads,
                   "chunk": args.chunk, "rounds": args.rounds, "cache_bytes": cache_nbytes(here["cache"]),
                   "vs_window": values[len(values) // 2] / sorted(reference)[len(reference) // 2],
                   "load": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None}
            with (args.out / "decode.jsonl").open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps({k: v for k, v in row.items() if k != "ms_per_token_all"}), flush=True)


# ------------------------------------------------------------------------------------------------------
# report


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _accuracy_rows(out: Path) -> list[dict]:
    rows = [r for r in _read(out / "accuracy.jsonl") if "found" in r]
    for row in _read(out / "kvpress.jsonl"):
        if "found" in row:
            rows.append({**row, "family": "kvpress"})
    unique = {}  # a contestant measured twice (two runs appending) is listed once, its first row
    for row in rows:
        unique.setdefault((row["family"], row["name"], row["budget"], row["context"], row.get("chunk")), row)
    return list(unique.values())


def _kept(r: dict) -> str:
    if r["family"] == "full" or (r["family"] == "kvpress" and r["name"] == "no press"):
        return "100%"
    return f"{r['nbits']}-bit" if r["family"] == "quantized" else f"{r['budget']:.0%}"


def _mb(value: float | None) -> str:
    return "–" if value is None else f"{value / 2**20:.0f}"


def _summary(rows: list[dict]) -> list[str]:
    """Per context and kept fraction: the zoo's best policy, kvpress's best press, the window, QuantizedCache."""
    lines = ["## Summary: found / prompts, best of each side per kept fraction", "",
             "| context | kept | zoo `budget` best | kvpress best | `longformer` + 4 sinks | all zoo policies | "
             "all kvpress presses |", "|---|---|---|---|---|---|---|"]

    def best(group: list[dict]) -> str:
        if not group:
            return "–"
        top = max(sum(r["found"]) for r in group)
        names = sorted(r["name"].removeprefix("budget ") for r in group if sum(r["found"]) == top)
        return f"{top}/{len(group[0]['found'])} ({', '.join(names)})"

    def each(group: list[dict]) -> str:
        return ", ".join(f"{r['name'].removeprefix('budget ')} {sum(r['found'])}" for r in
                         sorted(group, key=lambda r: r["name"])) or "–"

    for context in sorted({r["context"] for r in rows}):
        here = [r for r in rows if r["context"] == context]
        for budget in sorted({r["budget"] for r in here if r["family"] in ("budget", "kvpress", "longformer")
                              and r["budget"] < 1}, reverse=True):
            at = [r for r in here if r["budget"] == budget]
            zoo = [r for r in at if r["family"] == "budget"]
            press = [r for r in at if r["family"] == "kvpress"]
            window = [r for r in at if r["family"] == "longformer"]
            lines.append(f"| {context} | {budget:.0%} | {best(zoo)} | {best(press)} | "
                         f"{best(window).split(' (')[0] if window else '–'} | {each(zoo)} | {each(press)} |")
    return lines + [""]


def cmd_report(args) -> None:
    rows = _accuracy_rows(args.out)
    lines = ["# Passkey retrieval with a bounded KV cache: SmolLM2-135M-Instruct", "",
             f"Commands, load and what each number means: docs/bench/kv/README.md. {NEW_TOKENS} greedy tokens; "
             "found = the key in them. Cache MB per prompt as held after the last token (QuantizedCache: its "
             "packed data, scales and zero points and the fp32 residual tokens, measured).", ""]
    lines += _summary(rows)
    for context in sorted({r["context"] for r in rows}):
        here = [r for r in rows if r["context"] == context]
        depths = sorted({d for r in here for d in r["depths"]})
        counts = sorted({len(r["found"]) for r in here})
        lines += [f"## {context} tokens ({'/'.join(map(str, counts))} prompts: depths "
                  f"{', '.join(f'{d:g}' for d in depths)})", "",
                  "| contestant | kept | cache MB / prompt | found | " + " | ".join(f"d={d:g}" for d in depths) + " |",
                  "|---|---|---|---|" + "---|" * len(depths)]
        for r in sorted(here, key=lambda r: (-r["budget"] if r["family"] != "quantized" else -2,
                                             r["family"] != "full", r["family"], r["name"])):
            per_depth = []
            for d in depths:
                hits = [f for f, dd in zip(r["found"], r["depths"], strict=True) if dd == d]
                per_depth.append(f"{sum(hits)}/{len(hits)}" if hits else "–")
            mb = r.get("per_prompt_bytes")
            name = r["name"] if r["family"] != "kvpress" else f"kvpress {r['name']}"
            lines.append(f"| {name} | {_kept(r)} | {'–' if mb is None else f'{mb / 2**20:.1f}'} | "
                         f"{sum(r['found'])}/{len(r['found'])} | " + " | ".join(per_depth) + " |")
        lines.append("")
    memory = [r for r in _read(args.out / "memory.jsonl") if "error" not in r and r.get("start_rss_bytes")]
    if memory:
        lines += ["## Peak RSS (one fresh process per row; batch 1, key at depth 0.5, 16 new tokens)", "",
                  "MB. *loaded*: after `from_pretrained` (the weights are a memory map of the safetensors file, "
                  "mostly not yet read); *before*: after a 256-token warm-up `generate` (every weight page read: "
                  "the model's real footprint), the baseline; *above*: the measured call's peak minus *before*.", "",
                  "| contestant | context | chunked prefill | zoo code | allocator | keys kept | cache MB | loaded | "
                  "before | peak prefill | peak decode | peak above before | ms / token |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in memory:
            peak = max(r["prefill_peak_rss_bytes"] or 0, r["decode_peak_rss_bytes"] or 0)
            allocator = ", ".join(r.get("env") or []) + (" malloc_trim per layer" if r.get("trim") else "")
            ms = f"{r['ms_per_token']:.0f}" if r.get("ms_per_token") else "–"
            lines.append(f"| {r['contestant']['name']} | {r['context']} | {r['chunk'] or 'no'} | "
                         f"{r.get('code', 'this commit')} | {allocator or 'glibc default'} | "
                         f"{r['tokens_kept'] or 'all'} | "
                         f"{r['cache_bytes'] / 2**20:.1f} | {_mb(r['model_rss_bytes'])} | "
                         f"{_mb(r['start_rss_bytes'])} | {_mb(r['prefill_peak_rss_bytes'])} | "
                         f"{_mb(r['decode_peak_rss_bytes'])} | {_mb(peak - r['start_rss_bytes'])} | {ms} |")
        lines.append("")
    decode = [r for r in _read(args.out / "decode.jsonl") if r.get("model") == "smollm2-135m"]
    if decode:
        lines += ["## Decode time per token, SmolLM2-135M (one process, contestants in interleaved rounds)", "",
                  "| context | contestant | cache MB | ms / token (median) | tokens timed | vs window | threads | "
                  "load (1/5/15 min) |", "|---|---|---|---|---|---|---|---|"]
        for r in decode:
            lines.append(f"| {r['context']} | {r['name']} | {r['cache_bytes'] / 2**20:.1f} | "
                         f"{r['ms_per_token']:.1f} | {r['tokens_timed']} | {r['vs_window']:.2f}x | {r['threads']} | "
                         f"{' / '.join(r['load'] or [])} |")
        lines.append("")
    (args.out / "kv.md").write_text("\n".join(lines))
    plot(rows, args.out / "kv.png")
    print(f"wrote {args.out / 'kv.md'} and {args.out / 'kv.png'}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415  (only for the report)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    contexts = sorted({r["context"] for r in rows})

    def label_of(r: dict) -> str:
        return r["name"] if r["family"] != "kvpress" else f"kvpress {r['name']}"

    labels = sorted({label_of(r) for r in rows if r.get("per_prompt_bytes") is not None})
    colours = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(contexts), figsize=(6.5 * len(contexts) + 3, 4.8), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        groups: dict[str, list] = {}
        for r in rows:
            if r["context"] == context and r.get("per_prompt_bytes") is not None:
                groups.setdefault(label_of(r), []).append((r["per_prompt_bytes"] / 2**20,
                                                           sum(r["found"]) / len(r["found"])))
        for label, points in sorted(groups.items()):  # one colour per contestant in every panel
            points.sort()
            peer = label.startswith("kvpress")
            ax.plot(*zip(*points, strict=True), "--" if peer else "-", marker="s" if peer else "o",
                    color=colours(labels.index(label) % 20), label=label)
        ax.set_xscale("log")
        ax.set_xlabel("cache MB per prompt")
        ax.set_ylabel("passkey found")
        ax.set_title(f"SmolLM2-135M, {context}-token passkey")
        ax.grid(alpha=0.3)
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines()}  # every contestant, once
    axes[0][-1].legend([handles[label] for label in labels], labels, fontsize=7, loc="upper left",
                       bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_measure":
        print(json.dumps(measure_one(json.loads(argv[1]))))
        return 0
    parser = argparse.ArgumentParser(prog="python -m zoo.bench.kv", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["prompts", "accuracy", "memory", "decode", "report"])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/kv"))
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--keys", type=int, default=2, help="prompts (keys) per context and depth")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--only", nargs="+", help="families to run: full budget longformer quantized")
    parser.add_argument("--no_quantized", action="store_true")
    parser.add_argument("--shared", action="store_true",
                        help="accuracy: one prefill for every contestant but longformer (shared_generate)")
    parser.add_argument("--batch", type=int, default=0, help="accuracy --shared: prompts per prefill (0: all)")
    parser.add_argument("--keys_per_depth", type=int, default=0, help="accuracy: the first N prompts per depth")
    parser.add_argument("--chunk", type=int, default=None, help="prefill_chunk_size (memory: default 512)")
    parser.add_argument("--tokens", type=int, default=512, help="memory: keys kept per layer")
    parser.add_argument("--new_tokens", type=int, default=16, help="memory: tokens generated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny", help="decode: the model")
    parser.add_argument("--rounds", type=int, default=3, help="decode: rounds over the contestants")
    parser.add_argument("--rows", nargs="+", default=["full", "budget-chunked", "window-chunked"],
                        choices=list(MEMORY_ROWS), help="memory: the rows measured, each in a fresh process")
    parser.add_argument("--env", nargs="+", help="memory: KEY=VALUE for the measuring process (MALLOC_ARENA_MAX=2)")
    parser.add_argument("--trim", action="store_true", help="memory: glibc malloc_trim(0) after every layer")
    parser.add_argument("--no_warmup", action="store_true", help="memory: no short generate before the measured one")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "prompts":
        print(write_prompts(args.out, args.contexts, args.depths, args.keys))
    elif args.command == "accuracy":
        cmd_accuracy(args)
    elif args.command == "decode":
        args.new_tokens = max(args.new_tokens, 8)
        cmd_decode_smollm2(args) if args.model == "smollm2" else cmd_decode(args)
    elif args.command == "memory":
        args.chunk = args.chunk or 512
        cmd_memory(args)
    else:
        cmd_report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
