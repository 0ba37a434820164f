"""NVIDIA kvpress 0.5.5 presses on the zoo's prompts (peer runs, in the environment that scripts/kvpress_env.sh
builds: kvpress pins transformers<5.3, so it cannot run in the zoo's own environment). Two prompt files:

    scripts/kvpress_env.sh
    # zoo eval (zoo/eval/run.py runs this itself): RUN_DIR/prompts.jsonl -> RUN_DIR/kvpress.jsonl, resumable
    .venv-kvpress/bin/python scripts/kvpress_peer.py --eval RUN_DIR \
        --model ~/.cache/attention_zoo/models/smollm2-135m-instruct-q4_1-v1 --budgets 0.5 0.25 0.1
    # the passkey benchmark of zoo/bench/kv.py: OUT/prompts.json -> OUT/kvpress.jsonl (its accuracy rows' format)
    .venv-kvpress/bin/python scripts/kvpress_peer.py --out results/bench/kv \
        --model ~/.cache/attention_zoo/models/smollm2-135m-instruct-q4_1-v1 --contexts 1024 --budgets 0.5 0.25 0.1

Each press compresses the prompt once, at prefill (kvpress's forward hook, after each layer's full prefill), keeping
``budget`` of the keys (``compression_ratio = 1 - budget``); then greedy tokens from the compressed cache, at
positions that continue from the tokens seen (a pruned cache is shorter). "SnapKV (no question)" compresses the
prompt without its question, which is then fed uncompressed. DecodingPress never compresses the prefill: it evicts
down to ``int(budget * prompt length)`` keys at every decoding step. A sample's prompt length is ``len(ids)``, not
its ``length`` (the cell key: RULER's own prompts are shorter, each its own); a batch holds prompts of one length.
With ``--eval`` (and ``--shared``) one prefill serves every press (:func:`run_shared`); a group's rows share its
wall seconds. Eval rows hold the decoded ``outputs`` only: the zoo scores them. Standalone: imports nothing from the
zoo (its ``zoo/reporting.py``, standard library only, is loaded by path for JSON lines); torch, transformers and
kvpress are imported only where kvpress is installed, so the pure functions (groups, pending jobs, rows) import
anywhere (tests).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import time
from pathlib import Path

if importlib.util.find_spec("kvpress") is not None:  # the kvpress environment (elsewhere: the pure functions only)
    import torch
    import transformers
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

PASSKEY_NEW_TOKENS = 8
QUESTION = "What is the pass key? The pass key is"
NO_PRESS = "no press"
PREFILL = ("StreamingLLM", "KNorm", "SnapKV", "SnapKV (no question)", "TOVA", "ExpectedAttention", "ObservedAttention")
DECODING = ("DecodingPress (KNorm)", "DecodingPress (TOVA)")
PRESSES = PREFILL + DECODING
EVAL_DEFAULT_PREFILL = ("StreamingLLM", "KNorm", "SnapKV", "TOVA", "ExpectedAttention")
EVAL_DEFAULT_DECODING = ("DecodingPress (KNorm)",)


# ---- pure functions (no torch, no kvpress) ----

def _load_reporting():
    """The zoo's ``zoo/reporting.py`` (JSON lines), loaded by its path: it imports only the standard library, and
    the kvpress environment has no zoo to import it from."""
    spec = importlib.util.spec_from_file_location("zoo_reporting",
                                                  Path(__file__).resolve().parents[1] / "zoo" / "reporting.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_reporting = _load_reporting()
read_jsonl, append_jsonl = _reporting.read_jsonl, _reporting.append_jsonl


def contestant(press: str, budget: float) -> str:
    """The row's name in zoo eval: ``kvpress no press``, ``kvpress SnapKV 25%``."""
    return f"kvpress {press}" if press == NO_PRESS else f"kvpress {press} {round(budget * 100, 4):g}%"


def kind(press: str) -> str:
    """The prefill a press needs: ``sdpa`` (shared), ``eager`` (ObservedAttention), ``no question``."""
    return "eager" if press == "ObservedAttention" else "no question" if press.endswith("(no question)") else "sdpa"


def eval_specs(budgets: list[float], decoding_budgets: list[float], only: list[str] | None = None) -> list[tuple]:
    """(press, budget) of an eval run: no press, each prefill press at each budget, DecodingPress at each decoding
    budget. ``only`` names the presses (it can name ObservedAttention, SnapKV (no question), DecodingPress (TOVA))."""
    prefill = [p for p in PREFILL if p in only] if only else list(EVAL_DEFAULT_PREFILL)
    decoding = [p for p in DECODING if p in only] if only else list(EVAL_DEFAULT_DECODING)
    specs = [(NO_PRESS, 1.0)] if not only or NO_PRESS in only else []
    specs += [(press, budget) for budget in budgets for press in prefill]
    return specs + [(press, budget) for budget in decoding_budgets for press in decoding]


def passkey_specs(budgets: list[float], only: list[str] | None = None) -> list[tuple]:
    """(press, budget) of the passkey benchmark: no press, then every press at every budget."""
    specs = [(NO_PRESS, 1.0)] + [(press, budget) for budget in budgets for press in PRESSES]
    return [spec for spec in specs if not only or spec[0] in only]


def unknown_presses(only: list[str] | None) -> list[str]:
    return [name for name in only or [] if name != NO_PRESS and name not in PRESSES]


def group_samples(samples: list[dict], tasks: list[str] | None = None,
                  lengths: list[int] | None = None) -> list[tuple[tuple[str, int], list[dict]]]:
    """((task, length), samples by index) in the file's order, restricted to ``tasks`` and ``lengths``."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for sample in samples:
        if (tasks and sample["task"] not in tasks) or (lengths and sample["length"] not in lengths):
            continue
        groups.setdefault((sample["task"], sample["length"]), []).append(sample)
    return [(key, sorted(group, key=lambda s: s["index"])) for key, group in groups.items()]


def batches(samples: list[dict], size: int, by_question: bool = False) -> list[list[dict]]:
    """Batches of ``size`` (0: all) of one prompt length (``len(ids)``, so the ids stack without padding) and, with
    ``by_question``, of one ``question_tokens``: the parts in the order of their first sample, each in its samples'
    order (samples of one length and question: batches of the samples' order)."""
    parts: dict[tuple, list[dict]] = {}
    for sample in samples:
        parts.setdefault((len(sample["ids"]), sample["question_tokens"] if by_question else None), []).append(sample)
    return [part[i : i + (size or len(part))] for part in parts.values()
            for i in range(0, len(part), size or len(part))]


def prompt_length(part: list[dict]) -> int:
    """The prompt length of a batch: its samples' one ``len(ids)``."""
    lengths = {len(s["ids"]) for s in part}
    if len(lengths) != 1:
        raise ValueError(f"a batch of prompt lengths {sorted(lengths)}: batches() gives one length per batch")
    return lengths.pop()


def kept_keys(budget: float, prompt_len: int) -> int:
    """The keys DecodingPress keeps of a prompt of ``prompt_len`` tokens (``len(ids)``, not the cell's length)."""
    return int(budget * prompt_len)


def by_index(samples: list[dict], outputs: list) -> tuple[list[dict], list]:
    """Samples and their outputs, paired, in the samples' index order (batches by prompt length reorder them)."""
    pairs = sorted(zip(samples, outputs, strict=True), key=lambda pair: pair[0]["index"])
    return [s for s, _ in pairs], [o for _, o in pairs]


def finished(rows: list[dict]) -> set[tuple[str, str, int]]:
    """(contestant, task, length) of the rows without an error (skipped by a resumed run)."""
    return {(r["contestant"], r["task"], r["length"]) for r in rows if "error" not in r and "contestant" in r}


def pending(specs: list[tuple], task: str, length: int, done: set[tuple[str, str, int]]) -> list[tuple]:
    """The specs of ``(task, length)`` still to run."""
    return [(press, budget) for press, budget in specs if (contestant(press, budget), task, length) not in done]


def by_kind(specs: list[tuple]) -> list[tuple[str, list[tuple]]]:
    """The specs split by the prefill they need, in the order sdpa, eager, no question."""
    kinds = [(k, [spec for spec in specs if kind(spec[0]) == k]) for k in ("sdpa", "eager", "no question")]
    return [(k, group) for k, group in kinds if group]


def fields(press: str, budget: float) -> dict:
    """What zoo eval's report finds a row by (zoo/eval/rows.py), never its name."""
    return {"contestant": contestant(press, budget), "source": "kvpress", "family": "kvpress", "press": press,
            "policy": press, "budget": budget, "tokens": None, "nbits": None, "decoding": press in DECODING}


def eval_row(press: str, budget: float, samples: list[dict], outputs: list[str], nbytes: int, seconds: float,
             threads: int, versions: dict) -> dict:
    """One row of RUN_DIR/kvpress.jsonl; ``nbytes``: the cache bytes of all samples (the row has per sample);
    ``indices`` and ``outputs`` paired in index order; ``length``: the cell's (task, length) key."""
    samples, outputs = by_index(samples, outputs)
    return {**fields(press, budget), "task": samples[0]["task"], "length": samples[0]["length"],
            "indices": [s["index"] for s in samples],
            "outputs": outputs, "cache_bytes": nbytes // len(samples), "seconds": seconds, "threads": threads,
            "shared_prefill": True, **versions}


def eval_error_row(press: str, budget: float, task: str, length: int, error: str, threads: int,
                   versions: dict) -> dict:
    return {**fields(press, budget), "task": task, "length": length, "error": error, "threads": threads, **versions}


def passkey_row(press: str, budget: float, samples: list[dict], answers: list[str], nbytes: int, seconds: float,
                threads: int, shared: bool) -> dict:
    """One row in the format of zoo/bench/kv.py's accuracy rows (``found``: the key is in the answer)."""
    return {"name": press, "budget": budget, "context": samples[0]["length"],
            "per_prompt_bytes": nbytes // len(samples),
            "found": [s["answers"][0] in a for s, a in zip(samples, answers, strict=True)],
            "depths": [s["depth"] for s in samples], "answers": answers, "seconds": seconds, "threads": threads,
            "shared_prefill": shared}


def passkey_samples(prompts: list[dict], keys_per_depth: int = 0) -> list[dict]:
    """The passkey prompts (prompts.json) as eval samples (task ``passkey``, answer the key); ``keys_per_depth``:
    the first N prompts per depth and context."""
    samples, seen = [], {}
    for prompt in prompts:
        place = (prompt["context"], prompt["depth"])
        seen[place] = seen.get(place, 0) + 1
        if keys_per_depth and seen[place] > keys_per_depth:
            continue
        samples.append({"task": "passkey", "length": prompt["context"], "index": len(samples), "ids": prompt["ids"],
                        "answers": [str(prompt["key"])], "depth": prompt["depth"],
                        "new_tokens": PASSKEY_NEW_TOKENS})
    return samples


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ---- kvpress and torch ----

def make_press(press: str, budget: float, prompt_len: int):
    """The press ``press`` keeping ``budget`` of the prompt (None for no press); DecodingPress keeps
    ``int(budget * prompt_len)`` keys (:func:`kept_keys`) at every decoding step, scored by its base press after that
    step's attention."""
    ratio, kept = 1 - budget, kept_keys(budget, prompt_len)
    makers = {
        NO_PRESS: lambda: None,
        "StreamingLLM": lambda: StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "KNorm": lambda: KnormPress(compression_ratio=ratio),
        "SnapKV": lambda: SnapKVPress(compression_ratio=ratio),
        "SnapKV (no question)": lambda: SnapKVPress(compression_ratio=ratio),
        "TOVA": lambda: TOVAPress(compression_ratio=ratio),
        "ExpectedAttention": lambda: ExpectedAttentionPress(compression_ratio=ratio),
        "ObservedAttention": lambda: ObservedAttentionPress(compression_ratio=ratio),
        "DecodingPress (KNorm)": lambda: DecodingPress(base_press=KnormPress(), compression_interval=1,
                                                       target_size=kept, hidden_states_buffer_size=0),
        "DecodingPress (TOVA)": lambda: DecodingPress(base_press=TOVAPress(), compression_interval=1,
                                                      target_size=kept, hidden_states_buffer_size=1),
    }
    return makers[press]()


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def copy_cache(layers) -> DynamicCache:
    """A cache of its own holding these (keys, values) per layer (the update a prefill call makes)."""
    cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


def decode(model, cache, first: torch.Tensor, seen: int, new_tokens: int, decoding_press=None) -> torch.Tensor:
    """``first`` (batch,) then ``new_tokens - 1`` greedy tokens from ``cache`` (``seen`` tokens so far): explicit
    positions, as kvpress's own pipeline passes them, since a pruned cache is shorter than the tokens seen."""
    tokens = [first]
    with decoding_press(model) if decoding_press is not None else contextlib.nullcontext():
        for step in range(new_tokens - 1):
            positions = torch.full((first.shape[0], 1), seen + step)
            extra = {"cache_position": positions[0]} if decoding_press is not None else {}  # it tells decoding by it
            out = model(tokens[-1][:, None], past_key_values=cache, use_cache=True, position_ids=positions, **extra)
            tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, dim=1)


def run_shared(model, ids: torch.Tensor, presses: list, question: torch.Tensor | None, new_tokens: int) -> list:
    """One prefill for every press of ``presses`` (None: no press): a forward hook on each attention layer gives each
    prefill press a cache of its own holding this layer's keys and values and calls that press's own
    ``forward_hook`` on it, which compresses it as in a prefill of its own (a press compresses a layer's cache after
    the layer's attention call, so no prefill output depends on it). ``question`` (batch, q): the last q ids, fed
    after the compression. The first token comes from the prefill (or the question); each press then decodes from
    its own cache; DecodingPress and no press from a copy of the full cache. A single press uses the shared cache
    itself (a prefill of its own). Returns (tokens, cache bytes) per press, or the exception it raised."""
    context = ids if question is None else ids[:, : ids.shape[1] - question.shape[1]]
    own = len(presses) == 1
    prefill = [(i, p) for i, p in enumerate(presses) if p is not None and not isinstance(p, DecodingPress)]
    caches = {i: DynamicCache() for i, _ in prefill}
    results: list = [None] * len(presses)
    for _, press in prefill:
        press.post_init_from_model(model)

    def fan_out(module, args, kwargs, output):
        held = kwargs["past_key_values"].layers[module.layer_idx]
        for i, press in list(prefill):
            try:
                if own:
                    press.forward_hook(module, args, kwargs, output)
                else:
                    caches[i].update(held.keys, held.values, module.layer_idx)
                    press.forward_hook(module, args, {**kwargs, "past_key_values": caches[i]}, output)
            except Exception as exc:  # this press fails; the others go on
                results[i] = exc
                prefill.remove((i, press))
                caches.pop(i, None)
        return output

    shared = DynamicCache()
    for layer in model.model.layers:  # what a press's own context manager sets (its scores rotate queries)
        layer.self_attn.rotary_emb = model.model.rotary_emb
    hooks = [layer.self_attn.register_forward_hook(fan_out, with_kwargs=True) for layer in model.model.layers]
    try:
        out = model(context, past_key_values=shared, use_cache=True, logits_to_keep=1)  # as generate: the last
    finally:
        for hook in hooks:
            hook.remove()
    seen, first = context.shape[1], out.logits[:, -1].argmax(-1)
    full = [(layer.keys, layer.values) for layer in shared.layers]
    del out
    for i, press in enumerate(presses):
        if results[i] is not None:
            continue
        cache = shared if own else caches.pop(i) if i in caches else copy_cache(full)
        try:
            here, token = seen, first
            if question is not None:
                length = question.shape[1]
                positions = torch.arange(seen, seen + length)[None].expand(ids.shape[0], -1)
                asked = model(question, past_key_values=cache, use_cache=True, position_ids=positions,
                              logits_to_keep=1)
                here, token = seen + length, asked.logits[:, -1].argmax(-1)
            tokens = decode(model, cache, token, here, new_tokens, press if isinstance(press, DecodingPress) else None)
            results[i] = (tokens, cache_bytes(cache))
        except Exception as exc:  # recorded; the other presses go on
            results[i] = exc
        del cache
    return results


def answer_group(model, samples: list[dict], specs: list[tuple], batch: int, new_tokens: int,
                 question_of=None, by_question: bool = False) -> list[dict]:
    """Every spec's answers to ``samples`` (one task and length), batch by batch (each of one prompt length), one
    prefill per batch for all of ``specs``; a press per spec and prompt length. ``question_of(batch, ids)``: the
    question ids fed after the compression (None: no such split); ``by_question``: batches of one question length.
    Per spec: {"samples", "tokens" (per batch, in the order of "samples"), "bytes", "seconds" (the group's),
    "error"}."""
    states = [{"samples": [], "tokens": [], "bytes": 0, "seconds": 0.0, "error": None, "spec": spec,
               "presses": {}} for spec in specs]
    parts = batches(samples, batch, by_question)
    for state in states:  # a press per prompt length, made before the clock starts
        try:
            for prompt_len in dict.fromkeys(prompt_length(part) for part in parts):
                state["presses"][prompt_len] = make_press(*state["spec"], prompt_len)
        except Exception as exc:
            state["error"] = describe(exc)
    start = time.perf_counter()
    for part in parts:
        prompt_len = prompt_length(part)
        live = [state for state in states if state["error"] is None]
        if not live:
            break
        ids = torch.tensor([s["ids"] for s in part])
        try:
            with torch.no_grad():
                question = question_of(part, ids) if question_of is not None else None
                results = run_shared(model, ids, [state["presses"][prompt_len] for state in live], question,
                                     new_tokens)
        except Exception as exc:  # the prefill itself failed: every press of it
            results = [exc] * len(live)
        for state, result in zip(live, results, strict=True):
            if isinstance(result, BaseException):
                state["error"] = describe(result)
            else:
                state["samples"] += part
                state["tokens"].append(result[0])
                state["bytes"] += result[1]
    seconds = time.perf_counter() - start
    for state in states:
        state["seconds"] = seconds
    return states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--eval", type=Path, metavar="RUN_DIR", help="answer zoo eval's RUN_DIR/prompts.jsonl")
    parser.add_argument("--out", type=Path, default=Path("results/bench/kv"), help="the passkey benchmark's folder")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    parser.add_argument("--decoding_budgets", type=float, nargs="+", default=[0.1],
                        help="--eval: the budgets of DecodingPress (the passkey benchmark: every budget)")
    parser.add_argument("--only", nargs="+", help="press names to run ('no press' included)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help="prompts per forward (0: a whole group at once)")
    parser.add_argument("--tasks", nargs="+", help="--eval: these task labels only")
    parser.add_argument("--lengths", type=int, nargs="+", help="--eval: these lengths only")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024], help="passkey: these contexts")
    parser.add_argument("--shared", action="store_true", help="passkey: one prefill per kind for every press")
    parser.add_argument("--keys_per_depth", type=int, default=0, help="passkey: the first N prompts per depth")
    args = parser.parse_args()
    if importlib.util.find_spec("kvpress") is None:
        raise SystemExit("kvpress_peer: kvpress is not installed here; run scripts/kvpress_env.sh and use "
                         ".venv-kvpress/bin/python")
    if unknown_presses(args.only):
        raise SystemExit(f"kvpress_peer: unknown presses {unknown_presses(args.only)}; known: {NO_PRESS!r}, "
                         f"{', '.join(map(repr, PRESSES))}")
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # the weights' loading bar, per model
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    models: dict = {}

    def model_for(prefill: str):
        impl = "eager" if prefill == "eager" else "sdpa"
        if impl not in models:
            models[impl] = LlamaForCausalLM.from_pretrained(args.model, attn_implementation=impl).eval()
        return models[impl]

    if args.eval is not None:
        run_eval(args, tokenizer, model_for)
    else:
        run_passkey(args, tokenizer, model_for)


def split_question(part: list[dict], ids: torch.Tensor) -> torch.Tensor:
    """The question of a batch of one ``question_tokens``: its last ids."""
    return ids[:, ids.shape[1] - part[0]["question_tokens"]:]


def run_eval(args, tokenizer, model_for) -> None:
    """zoo eval's prompts: rows appended to RUN_DIR/kvpress.jsonl, the finished ones skipped."""
    path = args.eval / "kvpress.jsonl"
    versions = {"transformers": transformers.__version__, "kvpress": importlib.metadata.version("kvpress")}
    done = finished(read_jsonl(path))
    groups = group_samples(read_jsonl(args.eval / "prompts.jsonl"), args.tasks, args.lengths)
    specs = eval_specs(args.budgets, args.decoding_budgets, args.only)
    try:
        from tqdm import tqdm

        groups = tqdm(groups, desc="kvpress peer", unit="group")
    except ImportError:
        pass
    for (task, length), samples in groups:
        todo = pending(specs, task, length, done)
        new_tokens = max(2, samples[0]["new_tokens"])  # as zoo eval's own answers
        for prefill, group in by_kind(todo):
            asks = prefill == "no question"  # its samples' own questions, fed after the compression
            try:
                states = answer_group(model_for(prefill), samples, group, args.batch, new_tokens,
                                      split_question if asks else None, by_question=asks)
            except Exception as exc:  # e.g. the model failed to load
                states = [{"error": describe(exc)} for _ in group]
            for (press, budget), state in zip(group, states, strict=True):
                if state["error"] is not None:
                    row = eval_error_row(press, budget, task, length, state["error"], args.threads, versions)
                else:
                    outputs = tokenizer.batch_decode(until_end(torch.cat(state["tokens"]), tokenizer.eos_token_id),
                                                     skip_special_tokens=True)
                    row = eval_row(press, budget, state["samples"], outputs, state["bytes"], state["seconds"],
                                   args.threads, versions)
                append_jsonl(path, row)
                print(json.dumps({k: row[k] for k in ("contestant", "task", "length", "seconds", "error")
                                  if k in row}), flush=True)


def until_end(tokens, eos: int | None):
    """Each row's tokens up to its first end-of-sequence token (the rest turned into it), as ``generate`` pads a row
    that has ended: zoo eval's own answers end there."""
    if eos is None:
        return tokens
    ended = (tokens == eos).cumsum(dim=1) > 0
    return tokens.masked_fill(ended, eos)


def run_passkey(args, tokenizer, model_for) -> None:
    """The passkey benchmark's prompts (OUT/prompts.json): rows appended to OUT/kvpress.jsonl in its format."""
    question = torch.tensor([tokenizer(QUESTION, add_special_tokens=False).input_ids])
    samples = passkey_samples(json.loads((args.out / "prompts.json").read_text()), args.keys_per_depth)
    for (_, context), group in group_samples(samples, lengths=args.contexts):
        specs = passkey_specs(args.budgets, args.only)
        sets = by_kind(specs) if args.shared else [(kind(press), [(press, budget)]) for press, budget in specs]
        for prefill, jobs in sets:
            asks = (lambda part, ids: question.expand(ids.shape[0], -1)) if prefill == "no question" else None
            states = answer_group(model_for(prefill), group, jobs, args.batch, PASSKEY_NEW_TOKENS, asks)
            for (press, budget), state in zip(jobs, states, strict=True):
                if state["error"] is not None:
                    row = {"name": press, "budget": budget, "context": context, "error": state["error"]}
                else:
                    answers = tokenizer.batch_decode(torch.cat(state["tokens"]))
                    row = passkey_row(press, budget, state["samples"], answers, state["bytes"], state["seconds"],
                                      args.threads, args.shared)
                append_jsonl(args.out / "kvpress.jsonl", row)
                print(json.dumps({k: row.get(k) for k in ("name", "budget", "context", "found", "seconds", "error")
                                  if k in row}), flush=True)


if __name__ == "__main__":
    main()
