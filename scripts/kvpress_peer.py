"""NVIDIA kvpress 0.5.5 presses on the passkey prompts of zoo/bench/kv.py (peer runs, in the environment that
scripts/kvpress_env.sh builds: kvpress pins transformers<5.3, so it cannot run in the zoo's own environment).

    scripts/kvpress_env.sh
    .venv-kvpress/bin/python scripts/kvpress_peer.py \
        --model ~/.cache/attention_zoo/models/smollm2-135m-instruct-q4_1-v1 \
        --out results/bench/kv --contexts 1024 --budgets 0.5 0.25 0.1

Each press compresses the prompt once, at prefill (kvpress's forward hooks, after each layer's full prefill), keeping
``budget`` of the keys (``compression_ratio = 1 - budget``); then 8 greedy tokens with the compressed cache. "SnapKV
(no question)" compresses the prompt without its question, which is then fed uncompressed. Rows are appended to
``kvpress.jsonl`` in the format of zoo/bench/kv.py's accuracy rows. Standalone: imports nothing from the zoo.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from kvpress import (
    DecodingPress,
    ExpectedAttentionPress,
    KnormPress,
    ObservedAttentionPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM

NEW_TOKENS = 8
QUESTION = "What is the pass key? The pass key is"


def presses(ratio: float, kept: int) -> dict:
    """The presses at ``compression_ratio=ratio``; DecodingPress (which never compresses the prefill) evicts down to
    ``kept`` keys at every decoding step, scored by its base press, after that step's attention."""
    return {
        "StreamingLLM": StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "KNorm": KnormPress(compression_ratio=ratio),
        "SnapKV": SnapKVPress(compression_ratio=ratio),
        "SnapKV (no question)": SnapKVPress(compression_ratio=ratio),
        "TOVA": TOVAPress(compression_ratio=ratio),
        "ExpectedAttention": ExpectedAttentionPress(compression_ratio=ratio),
        "ObservedAttention": ObservedAttentionPress(compression_ratio=ratio),
        "DecodingPress (KNorm)": DecodingPress(base_press=KnormPress(), compression_interval=1, target_size=kept,
                                               hidden_states_buffer_size=0),
        "DecodingPress (TOVA)": DecodingPress(base_press=TOVAPress(), compression_interval=1, target_size=kept,
                                              hidden_states_buffer_size=1),
    }


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def run(model, ids: torch.Tensor, press, question_ids: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    cache = DynamicCache()
    context = ids if question_ids is None else ids[:, : ids.shape[1] - question_ids.shape[1]]
    decoding = isinstance(press, DecodingPress)  # active during the decoding steps too
    if press is None or decoding:
        out = model(context, past_key_values=cache, use_cache=True)
    else:
        with press(model):
            out = model(context, past_key_values=cache, use_cache=True)
    # explicit positions, as kvpress's own pipeline passes them: the pruned cache is shorter than the tokens seen
    seen = context.shape[1]
    if question_ids is not None:
        length = question_ids.shape[1]
        positions = torch.arange(seen, seen + length)[None].expand(ids.shape[0], -1)
        out = model(question_ids.expand(ids.shape[0], -1), past_key_values=cache, use_cache=True,
                    position_ids=positions)
        seen += length
    tokens = [out.logits[:, -1].argmax(-1)]
    with press(model) if decoding else contextlib.nullcontext():
        for step in range(NEW_TOKENS - 1):
            positions = torch.full((ids.shape[0], 1), seen + step)
            extra = {"cache_position": positions[0]} if decoding else {}  # DecodingPress tells decoding from it
            out = model(tokens[-1][:, None], past_key_values=cache, use_cache=True, position_ids=positions, **extra)
            tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, dim=1), cache_bytes(cache)


def copy_cache(layers) -> DynamicCache:
    """A cache of its own holding these (keys, values) per layer (the update a prefill call makes)."""
    cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


def decode(model, cache, first: torch.Tensor, seen: int, decoding_press=None) -> torch.Tensor:
    """``first`` (batch,) then NEW_TOKENS - 1 greedy tokens from ``cache`` (``seen`` tokens so far)."""
    tokens = [first]
    with decoding_press(model) if decoding_press is not None else contextlib.nullcontext():
        for step in range(NEW_TOKENS - 1):
            positions = torch.full((first.shape[0], 1), seen + step)
            extra = {"cache_position": positions[0]} if decoding_press is not None else {}
            out = model(tokens[-1][:, None], past_key_values=cache, use_cache=True, position_ids=positions, **extra)
            tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, dim=1)


@torch.no_grad()
def run_shared(model, ids: torch.Tensor, jobs: list, question_ids: torch.Tensor | None) -> list:
    """One prefill for every prefill press of ``jobs``: a forward hook on each attention layer gives each press a
    cache of its own holding this layer's keys and values and calls that press's own ``forward_hook`` on it, which
    compresses it as in a prefill of its own (a press compresses a layer's cache after the layer's attention call,
    so no prefill output depends on it). The first token comes from that prefill; each press then decodes from its
    own cache. DecodingPress and "no press" decode from a copy of the full cache. Returns (tokens, bytes) per job."""
    context = ids if question_ids is None else ids[:, : ids.shape[1] - question_ids.shape[1]]
    prefill = [(i, press) for i, (_, press) in enumerate(jobs) if press is not None
               and not isinstance(press, DecodingPress)]
    caches = {i: DynamicCache() for i, _ in prefill}
    for _, press in prefill:
        press.post_init_from_model(model)

    def fan_out(module, args, kwargs, output):
        held = kwargs["past_key_values"].layers[module.layer_idx]
        for i, press in prefill:
            caches[i].update(held.keys, held.values, module.layer_idx)
            press.forward_hook(module, args, {**kwargs, "past_key_values": caches[i]}, output)
        return output

    shared = DynamicCache()
    for layer in model.model.layers:  # what a press's own context manager sets (its scores rotate queries)
        layer.self_attn.rotary_emb = model.model.rotary_emb
    hooks = [layer.self_attn.register_forward_hook(fan_out, with_kwargs=True) for layer in model.model.layers]
    try:
        out = model(context, past_key_values=shared, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    seen, first = context.shape[1], out.logits[:, -1].argmax(-1)
    full = [(layer.keys, layer.values) for layer in shared.layers]
    del shared, out
    results = []
    for i, (_, press) in enumerate(jobs):
        cache = caches.pop(i) if i in caches else copy_cache(full)
        here, token = seen, first
        if question_ids is not None:
            length = question_ids.shape[1]
            positions = torch.arange(seen, seen + length)[None].expand(ids.shape[0], -1)
            asked = model(question_ids.expand(ids.shape[0], -1), past_key_values=cache, use_cache=True,
                          position_ids=positions)
            here, token = seen + length, asked.logits[:, -1].argmax(-1)
        tokens = decode(model, cache, token, here, press if isinstance(press, DecodingPress) else None)
        results.append((tokens, cache_bytes(cache)))
        del cache
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("results/bench/kv"))
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    parser.add_argument("--only", nargs="+", help="press names to run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help="prompts per forward (0: all of a context at once)")
    parser.add_argument("--shared", action="store_true", help="one prefill per kind for every press (run_shared)")
    parser.add_argument("--keys_per_depth", type=int, default=0, help="the first N prompts per depth")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    models = {impl: LlamaForCausalLM.from_pretrained(args.model, attn_implementation=impl).eval()
              for impl in ("sdpa", "eager")}
    question = torch.tensor([tokenizer(QUESTION, add_special_tokens=False).input_ids])
    rows = json.loads((args.out / "prompts.json").read_text())
    for context in args.contexts:
        prompts = [row for row in rows if row["context"] == context]
        ids = torch.tensor([row["ids"] for row in prompts])
        jobs = [("no press", None, 1.0)]
        for budget in args.budgets:
            jobs += [(name, press, budget) for name, press in presses(1 - budget, int(budget * context)).items()]
        if args.keys_per_depth:
            prompts = [row for depth in sorted({r["depth"] for r in prompts})
                       for row in [r for r in prompts if r["depth"] == depth][: args.keys_per_depth]]
            ids = torch.tensor([row["ids"] for row in prompts])
        jobs = [job for job in jobs if not args.only or job[0] in args.only]
        size = args.batch or len(prompts)

        def write(name, budget, new, nbytes, seconds, shared=False, context=context, prompts=prompts):
            answers = tokenizer.batch_decode(new)
            row = {"name": name, "budget": budget, "context": context, "per_prompt_bytes": nbytes // len(prompts),
                   "found": [str(r["key"]) in a for r, a in zip(prompts, answers, strict=True)],
                   "depths": [r["depth"] for r in prompts], "answers": answers, "seconds": seconds,
                   "threads": args.threads, "shared_prefill": shared}
            with (args.out / "kvpress.jsonl").open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps({k: row.get(k) for k in ("name", "budget", "context", "found", "seconds")}), flush=True)

        if args.shared:  # three kinds of prefill: sdpa, eager (ObservedAttention), the context without its question
            kinds = {"sdpa": [], "eager": [], "no question": []}
            for job in jobs:
                kinds["eager" if job[0] == "ObservedAttention" else "no question" if
                      job[0].endswith("(no question)") else "sdpa"].append(job)
            for kind, group in kinds.items():
                if not group:
                    continue
                start = time.perf_counter()
                outputs = [[] for _ in group]
                nbytes = [0] * len(group)
                for first in range(0, len(prompts), size):
                    results = run_shared(models["eager" if kind == "eager" else "sdpa"], ids[first : first + size],
                                         [(name, press) for name, press, _ in group],
                                         question if kind == "no question" else None)
                    for index, (tokens, part) in enumerate(results):
                        outputs[index].append(tokens)
                        nbytes[index] += part
                seconds = time.perf_counter() - start
                for (name, _, budget), new, total in zip(group, outputs, nbytes, strict=True):
                    write(name, budget, torch.cat(new), total, seconds, shared=True)
            continue
        for name, press, budget in jobs:
            model = models["eager" if name == "ObservedAttention" else "sdpa"]
            start = time.perf_counter()
            try:
                new, nbytes = [], 0
                for first in range(0, len(prompts), size):
                    tokens, part = run(model, ids[first : first + size], press,
                                       question if name.endswith("(no question)") else None)
                    new.append(tokens)
                    nbytes += part
            except Exception as exc:  # recorded, the run goes on
                row = {"name": name, "budget": budget, "context": context, "error": f"{type(exc).__name__}: {exc}"}
                with (args.out / "kvpress.jsonl").open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
            else:
                write(name, budget, torch.cat(new), nbytes, time.perf_counter() - start)

if __name__ == "__main__":
    main()
