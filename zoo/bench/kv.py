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
from transformers import QuantizedCache

from zoo.cache import POLICIES, cache_nbytes
from zoo.data.pretrained import smollm2
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
    _, tokenizer = smollm2()
    rng = random.Random(seed)
    rows = [{"context": n, "depth": d, "key": rng.randrange(10000, 100000)} for n in contexts for d in depths
            for _ in range(keys)]
    for row in rows:
        row["ids"] = build_prompt(tokenizer, row["context"], row["depth"], row["key"])
    path = out / "prompts.json"
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
        nbytes = quantized_bytes(model.config, seen, contestant["nbits"], RECENT, len(prompts))
    else:
        nbytes = cache_nbytes(out.past_key_values)
    return {**{k: v for k, v in contestant.items()}, "context": context, "per_prompt_bytes": nbytes // len(prompts),
            "found": found, "depths": [row["depth"] for row in prompts], "answers": answers, "seconds": seconds,
            "chunk": chunk}


def cmd_accuracy(args) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = smollm2()
    path = args.out / "accuracy.jsonl"
    for context in args.contexts:
        prompts = load_prompts(args.out, context)
        for contestant in contestants(args.budgets, args.policies, quantized=not args.no_quantized):
            if args.only and contestant["family"] not in args.only:
                continue
            try:
                row = run_contestant(model, tokenizer, prompts, dict(contestant), args.chunk)
            except Exception as exc:  # recorded, the run goes on
                row = {**contestant, "context": context, "error": f"{type(exc).__name__}: {exc}"}
            with path.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps({k: row.get(k) for k in ("name", "budget", "context", "found", "seconds", "error")}),
                  flush=True)


# ------------------------------------------------------------------------------------------------------
# memory and decode time: one fresh process per measurement (peak RSS is per process)


def measure_one(setting: dict) -> dict:
    torch.set_num_threads(setting.get("threads", 2))
    model, tokenizer = smollm2()
    baseline = max_rss_bytes()
    context = setting["context"]
    ids = torch.tensor([build_prompt(tokenizer, context, 0.5, 12345)])
    contestant = dict(setting["contestant"])
    contestant["budget"] = setting["tokens"] / context if contestant["family"] in ("budget", "longformer") else 1.0
    kwargs = prepare(model, contestant, context, setting.get("chunk"))
    stamps: list[float] = []

    class Stamps:  # a streamer: the time of every emitted token
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=setting["new_tokens"],
                             do_sample=False, pad_token_id=tokenizer.eos_token_id, return_dict_in_generate=True,
                             streamer=Stamps(), **kwargs)
    gaps = sorted(b - a for a, b in zip(stamps[2:], stamps[3:], strict=False))  # after the prompt and the first token
    return {**setting, "tokens_kept": contestant.get("tokens"), "cache_bytes": cache_nbytes(out.past_key_values),
            "peak_rss_bytes": max_rss_bytes(), "model_rss_bytes": baseline,
            "ms_per_token": 1000 * gaps[len(gaps) // 2] if gaps else None}


def cmd_memory(args) -> None:
    path = args.out / "memory.jsonl"
    settings = []
    for context in args.contexts:
        settings += [
            {"contestant": {"name": "full cache (transformers)", "family": "full"}, "chunk": None},
            {"contestant": {"name": "full cache (transformers)", "family": "full"}, "chunk": args.chunk},
            {"contestant": {"name": "budget tova", "family": "budget", "policy": "tova"}, "chunk": None},
            {"contestant": {"name": "budget tova", "family": "budget", "policy": "tova"}, "chunk": args.chunk},
            {"contestant": {"name": "budget tova slack 64", "family": "budget", "policy": "tova", "slack": 64},
             "chunk": args.chunk},
            {"contestant": {"name": "longformer window + 4 sinks", "family": "longformer"}, "chunk": args.chunk},
        ]
        for setting in settings[-6:]:
            setting.update(context=context, tokens=args.tokens, new_tokens=args.new_tokens, threads=args.threads)
    if args.minimal:  # the target rows only: full cache unchunked, budget and window chunked
        settings = [s for s in settings if (s["contestant"]["family"] == "full") == (s["chunk"] is None)
                    and "slack" not in s["contestant"]]
    for setting in settings:
        if args.only and setting["contestant"]["family"] not in args.only:
            continue
        done = subprocess.run([sys.executable, "-m", "zoo.bench.kv", "_measure", json.dumps(setting)],
                              capture_output=True, text=True, timeout=args.timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if done.returncode == 0 and lines else {**setting, "error": done.stderr[-500:]}
        with path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps({k: row.get(k) for k in ("contestant", "context", "chunk", "cache_bytes", "peak_rss_bytes",
                                                  "ms_per_token", "error")}), flush=True)


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
                stamps: list[float] = []

                class Stamps:
                    def put(self, value, stamps=stamps):
                        stamps.append(time.perf_counter())

                    def end(self):
                        pass

                with torch.no_grad():
                    model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                   do_sample=False, streamer=Stamps(), **kwargs)
                gaps = sorted(b - a for a, b in zip(stamps[2:], stamps[3:], strict=False))
                times[setting["name"]].append(1000 * gaps[len(gaps) // 2])
        for name, values in times.items():
            row = {"context": context, "name": name, "ms_per_token": sorted(values)[len(values) // 2],
                   "rounds": values, "threads": args.threads}
            with (args.out / "decode.jsonl").open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
            values.clear()


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


def cmd_report(args) -> None:
    rows = _accuracy_rows(args.out)
    lines = ["# Passkey retrieval with a bounded KV cache: SmolLM2-135M-Instruct", "",
             f"Command lines: see docs/bench/kv/README.md. {NEW_TOKENS} greedy tokens; found = the key in them.", ""]
    for context in sorted({r["context"] for r in rows}):
        here = [r for r in rows if r["context"] == context]
        depths = sorted({d for r in here for d in r["depths"]})
        lines += [f"## {context} tokens ({len(here[0]['found'])} prompts: depths "
                  f"{', '.join(f'{d:g}' for d in depths)})", "",
                  "| contestant | kept | cache MB / prompt | found | " + " | ".join(f"d={d:g}" for d in depths) + " |",
                  "|---|---|---|---|" + "---|" * len(depths)]
        for r in sorted(here, key=lambda r: (-r["budget"], r["family"] != "full", r["family"], r["name"])):
            per_depth = []
            for d in depths:
                hits = [f for f, dd in zip(r["found"], r["depths"], strict=True) if dd == d]
                per_depth.append(f"{sum(hits)}/{len(hits)}")
            kept = "100%" if r["family"] == "full" else (f"{r['nbits']}-bit" if r["family"] == "quantized"
                                                          else f"{r['budget']:.0%}")
            mb = r.get("per_prompt_bytes")
            lines.append(f"| {r['name']} | {kept} | {mb / 2**20:.1f} | {sum(r['found'])}/{len(r['found'])} | "
                         + " | ".join(per_depth) + " |" if mb is not None else
                         f"| {r['name']} | {kept} | – | {sum(r['found'])}/{len(r['found'])} | " + " | ".join(per_depth)
                         + " |")
        lines.append("")
    memory = [r for r in _read(args.out / "memory.jsonl") if "error" not in r]
    if memory:
        lines += ["## Memory and decode time (one fresh process per row; batch 1, key at depth 0.5)", "",
                  "| contestant | context | chunked prefill | keys kept | cache MB | peak RSS MB (model alone) | "
                  "ms / token |", "|---|---|---|---|---|---|---|"]
        for r in memory:
            ms = f"{r['ms_per_token']:.1f}" if r.get("ms_per_token") else "–"
            lines.append(f"| {r['contestant']['name']} | {r['context']} | {r['chunk'] or 'no'} | "
                         f"{r['tokens_kept'] or 'all'} | {r['cache_bytes'] / 2**20:.1f} | "
                         f"{r['peak_rss_bytes'] / 2**20:.0f} ({r['model_rss_bytes'] / 2**20:.0f}) | {ms} |")
        lines.append("")
    (args.out / "kv.md").write_text("\n".join(lines))
    plot(rows, args.out / "kv.png")
    print(f"wrote {args.out / 'kv.md'} and {args.out / 'kv.png'}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415  (only for the report)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6.5 * len(contexts) + 3, 4.8), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        groups: dict[str, list] = {}
        for r in rows:
            if r["context"] == context and r.get("per_prompt_bytes") is not None:
                label = r["name"] if r["family"] != "kvpress" else f"kvpress {r['name']}"
                groups.setdefault(label, []).append((r["per_prompt_bytes"] / 2**20, sum(r["found"]) / len(r["found"])))
        colours = plt.get_cmap("tab20")
        for index, (label, points) in enumerate(sorted(groups.items())):
            points.sort()
            peer = label.startswith("kvpress")
            ax.plot(*zip(*points, strict=True), "--" if peer else "-", marker="s" if peer else "o",
                    color=colours(index % 20), label=label)
        ax.set_xscale("log")
        ax.set_xlabel("cache MB per prompt")
        ax.set_ylabel("passkey found")
        ax.set_title(f"SmolLM2-135M, {context}-token passkey")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
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
    parser.add_argument("--chunk", type=int, default=None, help="prefill_chunk_size (memory: default 512)")
    parser.add_argument("--tokens", type=int, default=512, help="memory: keys kept per layer")
    parser.add_argument("--new_tokens", type=int, default=16, help="memory: tokens generated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="decode: rounds over the contestants")
    parser.add_argument("--minimal", action="store_true", help="memory: full unchunked, budget and window chunked")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "prompts":
        print(write_prompts(args.out, args.contexts, args.depths, args.keys))
    elif args.command == "accuracy":
        cmd_accuracy(args)
    elif args.command == "decode":
        args.new_tokens = max(args.new_tokens, 8)
        cmd_decode(args)
    elif args.command == "memory":
        args.chunk = args.chunk or 512
        cmd_memory(args)
    else:
        cmd_report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
