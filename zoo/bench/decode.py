"""``zoo bench --decode``: per-token decode latency and cache bytes against the prompt length.

A tiny Llama (hidden 256, 4 heads, 2 layers, fp32, batch 1 by default) decodes greedily through
``model.generate`` after a random prompt of n tokens. Per n, every contestant runs in one process with a memory
cap (:class:`zoo.bench.measure.Runner`): each prefills once, then the contestants take turns, in ``rounds``
rounds of alternating order, continuing their own sequence and cache by ``new_tokens`` tokens. A single
``generate`` per contestant, each in a fresh process, moved by more than the differences measured (±50% on a
shared 2-core host); taking turns puts slow host noise on every contestant alike. The time per token is the
median gap between the time stamps a streamer records as tokens arrive, over all rounds (each call's first gap
left out); the cache bytes are those of the cache after the last round (``zoo.cache_nbytes``). Should the shared
process die (a contestant outgrew the machine), each contestant at that n is measured again in a process of its
own.

Contestants: every registered causal variant (``dense`` only when asked: it materializes n x n scores in the
prefill), each with the cache ``generate`` gives it, and two peers in the same run: ``transformers_sdpa`` (plain
transformers SDPA with its default ``DynamicCache``) and ``mistral_sliding_window`` (transformers' Mistral with its
native sliding-window cache). ``--window W`` sets the keys a windowed contestant keeps: Mistral's
``sliding_window=W``, ``xformers`` ``window=W``, causal ``longformer`` ``window=2W`` (W to the left) plus the 4
attention-sink tokens of StreamingLLM.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from zoo.bench.measure import Runner, measure_idle
from zoo.bench.plan import History, extrapolate
from zoo.bench.report import errors_section, grid, machine_info, plot_against_n, report_json, write_report
from zoo.bench.timer import TokenClock, take_turns
from zoo.cache import cache_nbytes
from zoo.plug.install import configure
from zoo.plug.spec import variant_for
from zoo.registry import get_variant_class, list_variants
from zoo.reporting import MB, fixed, human_bytes, markdown_table, write_csv

DECODE_LENGTHS = [2048, 8192, 32768, 131072]
SINK_TOKENS = [0, 1, 2, 3]
PEERS = ("transformers_sdpa", "mistral_sliding_window")
QUADRATIC_PREFILL = {"transformers_sdpa", "mistral_sliding_window", "sdpa", "dense"}


@dataclass
class DecodeSettings:
    lengths: list[int] = field(default_factory=lambda: list(DECODE_LENGTHS))
    new_tokens: int = 32  # per round
    rounds: int = 8  # interleaved rounds of new_tokens tokens per contestant
    window: int = 512
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    layers: int = 2
    vocab: int = 1024
    batch: int = 1
    device: str = "cpu"
    threads: int = field(default_factory=torch.get_num_threads)
    max_seconds: float = 300.0  # estimated seconds of one measurement (mostly prefill) above which n is skipped

    def check(self) -> None:
        problems = []
        if self.hidden % self.heads or self.heads % self.kv_heads:
            problems.append(f"--hidden {self.hidden}, --heads {self.heads}, kv heads {self.kv_heads} do not divide")
        if self.rounds < 1:
            problems.append(f"--repeats (rounds) must be >= 1, got {self.rounds}")
        if self.new_tokens < 3:
            problems.append(f"--new_tokens must be >= 3 (gaps between tokens are timed), got {self.new_tokens}")
        if not self.lengths or min(self.lengths) < 1:
            problems.append(f"--lengths must be positive integers, got {self.lengths}")
        if self.device != "cpu":
            problems.append("--decode measures on --device cpu only for now")
        if problems:
            raise ValueError("zoo bench --decode: " + "; ".join(problems) + ".")


@dataclass(frozen=True)
class DecodeContestant:
    """One model to decode with: a zoo variant (``variant`` + ``params``) or a transformers peer."""

    name: str
    kind: str  # "zoo" or "peer"
    variant: str | None = None
    params: dict = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(self.name)


def decode_params(variant: str, window: int) -> dict[str, Any]:
    """The settings a variant decodes with in this benchmark (the windowed ones see ``window`` keys)."""
    if variant == "longformer":
        return {"window": 2 * window, "global_tokens": SINK_TOKENS}
    if variant == "xformers":
        return {"window": window}
    return {}


def decode_contestants(names: list[str] | None, settings: DecodeSettings) -> list[DecodeContestant]:
    """The named contestants (default: every causal variant but ``dense``, and the peers)."""
    causal = [v for v in list_variants() if get_variant_class(v).supports_causal]
    names = names or [*PEERS, *(v for v in causal if v != "dense")]
    contestants = []
    for name in names:
        if name in PEERS:
            contestants.append(DecodeContestant(name, "peer"))
        elif name in causal:
            contestants.append(DecodeContestant(name, "zoo", name, decode_params(name, settings.window)))
        else:
            raise ValueError(
                f"zoo bench --decode: {name!r} is neither a causal variant ({', '.join(causal)}) nor a peer "
                f"({', '.join(PEERS)})."
            )
    return contestants


# ---------------------------------------------------------------------------------------------------
# one measurement (runs in its own process)


def model_config(contestant: DecodeContestant, settings: DecodeSettings, n: int):
    """The tiny Llama's (or Mistral's) config, configured with the contestant's variant."""
    import transformers


    dims = dict(
        vocab_size=settings.vocab, hidden_size=settings.hidden, intermediate_size=2 * settings.hidden,
        num_hidden_layers=settings.layers, num_attention_heads=settings.heads,
        num_key_value_heads=settings.kv_heads,
        max_position_embeddings=n + settings.rounds * settings.new_tokens + 64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if contestant.name == "mistral_sliding_window":
        config = transformers.MistralConfig(**dims, sliding_window=settings.window)
        config._attn_implementation = "sdpa"
    else:
        config = transformers.LlamaConfig(**dims)
        config._attn_implementation = "sdpa"
        if contestant.variant is not None:
            configure(config, contestant.variant, **contestant.params)
    return config


def build_model(contestant: DecodeContestant, settings: DecodeSettings, n: int):
    import transformers

    config = model_config(contestant, settings, n)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def cache_refusal(contestant: DecodeContestant, settings: DecodeSettings) -> str | None:
    """The reason a variant documents for not decoding with a cache (its ``cache_layer`` refuses), else None:
    a design choice the table shows as skipped, not as a failure."""
    if contestant.variant is None:
        return None

    config = model_config(contestant, settings, min(settings.lengths))
    try:
        variant_for(config).cache_layer(0, config)
    except ValueError as exc:
        return str(exc).split(". ", 1)[0].removeprefix(f"attention-zoo variant {contestant.variant!r} ")
    return None


def _generate(model, ids: torch.Tensor, new_tokens: int, **options: Any):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                          **options)  # fmt: skip


def measure_decode(contestants: list[DecodeContestant], settings: DecodeSettings, n: int) -> dict[str, Any]:
    """Every contestant at prompt length n in one process, timed in interleaved rounds.

    Each contestant's model prefills the prompt once (``generate`` of one token: ``first_token_s``); then, in each
    of ``settings.rounds`` rounds, every contestant's ``generate`` continues its own sequence and cache by
    ``new_tokens`` tokens, in alternating order (forwards, then backwards). Host noise that lasts longer than a
    round (other tenants, frequency changes) so falls on every contestant alike. Returns
    ``{"status": "ok", "results": {name: result}}``; a contestant that raises gets an error result and the others
    go on.
    """
    prompt = torch.randint(3, settings.vocab, (settings.batch, n), generator=torch.Generator().manual_seed(n))
    running: dict[str, list] = {}  # name -> [model, sequences, cache]

    def prefill(contestant: DecodeContestant) -> dict[str, Any]:
        model = build_model(contestant, settings, n)
        _generate(model, prompt[:, :64], 4)  # first-call overheads, untimed
        clock = TokenClock()
        start = time.perf_counter()
        out = _generate(model, prompt, 1, streamer=clock)
        running[contestant.name] = [model, out.sequences, out.cache]
        return {"first_token_s": clock.stamps[1] - start}

    def one_round(name: str) -> list[float]:
        model, sequences, cache = running[name]
        clock = TokenClock()
        out = _generate(model, sequences, settings.new_tokens, streamer=clock, cache=cache)
        running[name][1:] = [out.sequences, out.cache]
        return clock.token_gaps()

    players = {c.name: (partial(prefill, c), partial(one_round, c.name)) for c in contestants}
    with torch.inference_mode():
        results = take_turns(players, settings.rounds)
    for name, result in results.items():
        if result["status"] == "ok":
            gaps = result.pop("gaps")
            result.update(ms_per_token=1e3 * statistics.median(gaps), ms_per_token_min=1e3 * min(gaps),
                          cache_bytes=cache_nbytes(running[name][2]), cache_class=type(running[name][2]).__name__)
    return {"status": "ok", "results": results}


# ---------------------------------------------------------------------------------------------------
# the run


def _row(contestant: DecodeContestant, n: int, **values: Any) -> dict[str, Any]:
    return {"variant": contestant.name, "kind": contestant.kind, "n": n, "status": "ok", "note": "", **values}


def _skip_note(contestant: DecodeContestant, settings: DecodeSettings, n: int, history: History) -> str | None:
    if history.failed_at is not None:
        return f"skipped: failed at n={history.failed_at} (see Errors)"
    growth = 2.0 if contestant.name in QUADRATIC_PREFILL else 1.0
    estimate = extrapolate(history.times, n, lambda a, b: (b / a) ** growth, 1.0)
    if estimate is not None and estimate > settings.max_seconds:
        return f"skipped: est. {estimate:.0f} s > --max_seconds {settings.max_seconds:g}"
    return None


def _measure_length(runner: Runner, contestants: list[DecodeContestant], settings: DecodeSettings,
                    n: int) -> dict[str, dict[str, Any]]:
    """Each contestant's result at n: all of them in one process (taking turns); if that process dies or times
    out (one contestant outgrew the machine), each again in a process of its own, so one does not sink the rest."""
    timeout = len(contestants) * (60 + 3 * settings.max_seconds)
    together = runner.run(measure_decode, contestants, settings, n, timeout=timeout)
    if together["status"] == "ok":
        return together["results"]
    if len(contestants) == 1:
        return {contestants[0].name: together}
    results = {}
    for contestant in contestants:
        alone = runner.run(measure_decode, [contestant], settings, n, timeout=60 + 3 * settings.max_seconds)
        result = alone["results"][contestant.name] if alone["status"] == "ok" else alone
        results[contestant.name] = {**result, "note": f"measured alone (the shared process: {together['error']})"}
    return results


def run_decode_benchmark(settings: DecodeSettings, contestants: list[DecodeContestant],
                         progress: bool = True) -> dict[str, Any]:
    from tqdm.auto import tqdm

    runner = Runner(settings, [])
    runner.run(measure_idle, timeout=120)  # starts the forkserver before anything is timed
    histories = {c.name: History() for c in contestants}
    refusals = {c.name: cache_refusal(c, settings) for c in contestants}
    rows = []
    bar = tqdm(total=len(settings.lengths), disable=not progress, desc="zoo bench --decode")
    for n in settings.lengths:
        bar.set_postfix_str(f"n={n}")
        notes = {c.name: f"skipped: {refusals[c.name]}" if refusals[c.name]
                 else _skip_note(c, settings, n, histories[c.name]) for c in contestants}
        measured = [c for c in contestants if not notes[c.name]]
        results = _measure_length(runner, measured, settings, n) if measured else {}
        for contestant in contestants:
            history, result = histories[contestant.name], results.get(contestant.name)
            if result is None:
                rows.append(_row(contestant, n, status="skipped", note=notes[contestant.name]))
            elif result["status"] == "ok":
                history.times.append((n, result["first_token_s"]))
                rows.append(_row(contestant, n, cache_mb=result["cache_bytes"] / MB, note=result.get("note", ""),
                                 **{key: result[key] for key in MEASURED}))
            else:
                history.failed_at, history.failure = n, result["error"]
                rows.append(_row(contestant, n, status="error", note=f"error: {result['error']}"))
        bar.update()
    bar.close()
    return {
        "machine": machine_info(settings),
        "settings": {k: v for k, v in vars(settings).items()},
        "contestants": {c.name: {"kind": c.kind, "variant": c.variant, "params": c.params} for c in contestants},
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------------
# the report


MEASURED = ["ms_per_token", "ms_per_token_min", "round_ms", "first_token_s", "cache_class"]
CSV_FIELDS = ["variant", "kind", "n", "status", "ms_per_token", "ms_per_token_min", "first_token_s", "cache_mb",
              "cache_class", "note"]


def _ok(rows: list[dict[str, Any]], name: str, n: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["variant"] == name and r["n"] == n and r["status"] == "ok"), None)


def speedup(mine: dict[str, Any], theirs: dict[str, Any]) -> tuple[float, float, float]:
    """How many times faster per token ``mine`` is than ``theirs``: the ratio of their medians over every round's
    gaps (both took turns over the same stretch of time), with the lowest and highest ratio of a single round's
    medians (a round's two turns lie up to a round apart: their spread shows the host's)."""
    rounds = sorted(t / m for m, t in zip(mine["round_ms"], theirs["round_ms"], strict=True))
    return theirs["ms_per_token"] / mine["ms_per_token"], rounds[0], rounds[-1]


def _versus_table(report: dict[str, Any], peer: str) -> list[str]:
    """Per length: how many times faster per token than ``peer`` (with the range of single rounds), and the fraction
    of its cache bytes."""
    rows, lengths = report["rows"], report["settings"]["lengths"]
    lines = []
    for name in report["contestants"]:
        if name == peer:
            continue
        cells = []
        for n in lengths:
            mine, theirs = _ok(rows, name, n), _ok(rows, peer, n)
            if mine is None or theirs is None:
                cells.append("–")
            else:
                ratio, low, high = speedup(mine, theirs)
                cells.append(f"{ratio:.2f}x ({low:.2f}–{high:.2f}), "
                             f"{mine['cache_mb'] / max(theirs['cache_mb'], 1e-9):.3g} of cache")
        lines.append([name, *cells])
    return markdown_table(["vs " + peer, *(f"n={n}" for n in lengths)], lines)


def _growth_table(report: dict[str, Any]) -> list[str]:
    """Per-token time at each length over the time at the shortest one."""
    rows, lengths = report["rows"], report["settings"]["lengths"]
    lines = []
    for name in report["contestants"]:
        first = _ok(rows, name, lengths[0])
        cells = []
        for n in lengths[1:]:
            row = _ok(rows, name, n)
            cells.append("–" if row is None or first is None else f"{row['ms_per_token'] / first['ms_per_token']:.2f}x")
        lines.append([name, *cells])
    return markdown_table(["per-token time / time at n=" + str(lengths[0]), *(f"n={n}" for n in lengths[1:])], lines)


def render_markdown(report: dict[str, Any], command: str) -> str:
    s, m = report["settings"], report["machine"]
    names = list(report["contestants"])
    params = "; ".join(f"{name} {json.dumps(info['params'])}" for name, info in report["contestants"].items()
                       if info["params"])
    lines = [
        "# zoo bench --decode",
        "",
        f"Command: `{command}`",
        "",
        f"Tiny Llama: hidden {s['hidden']}, {s['heads']} heads ({s['kv_heads']} kv), {s['layers']} layers, vocab "
        f"{s['vocab']}, fp32, batch {s['batch']}. Per prompt length n, all contestants in one process: each "
        f"prefills an n-token prompt once, then greedy `model.generate` continues its own sequence and cache by "
        f"{s['new_tokens']} tokens in each of {s['rounds']} rounds, the contestants taking turns in alternating "
        f"order; time per token = median gap between a streamer's time stamps over the rounds (each call's first "
        f"token excluded); cache = bytes of the tensors in the cache after the last round. Window {s['window']} keys. "
        f"Machine: {m.get('cpu', '?')}, {s['threads']} threads, torch {m.get('torch', '?')}, "
        f"transformers {m.get('transformers', '?')}.",
        "",
        f"Parameters: {params or 'defaults'}.",
        "",
        "## Milliseconds per generated token",
        "",
        *grid(report["rows"], names, lambda r: fixed(r["ms_per_token"])),
        "",
        "## Cache bytes after generation",
        "",
        *grid(report["rows"], names, lambda r: f"{human_bytes(r['cache_mb'] * MB)} ({r['cache_class']})"),
        "",
        "## Against the peers (times faster per token, fraction of their cache bytes)",
        "",
        f"The peer's milliseconds per token over the contestant's (both medians over all {s['rounds']} rounds); in "
        f"brackets the lowest and highest ratio of a single round's medians.",
        "",
    ]
    for peer in PEERS:
        if peer in report["contestants"]:
            lines += [*_versus_table(report, peer), ""]
    alone = [f"- **{r['variant']}** (n={r['n']}): {r['note']}" for r in report["rows"]
             if r["status"] == "ok" and r["note"]]
    lines += ["## Growth with the prompt", "", *_growth_table(report), "", "## Errors", "",
              *errors_section(report["rows"]), *alone, ""]
    return "\n".join(lines)


def write_decode_outputs(report: dict[str, Any], output_dir: Path, command: str) -> dict[str, Path]:
    styles = {name: "--" if info["kind"] == "peer" else "-" for name, info in report["contestants"].items()}
    s = report["settings"]
    what = f"tiny Llama (hidden {s['hidden']}, {s['layers']} layers), greedy generate, {s['device']}"
    return write_report(output_dir, {
        "csv": ("decode.csv", lambda path: write_csv(path, report["rows"], CSV_FIELDS)),
        "json": ("decode.json", report_json(report, command)),
        "markdown": ("decode.md", render_markdown(report, command)),
        "time_plot": ("decode_ms_per_token.png", lambda path: plot_against_n(
            report["rows"], styles, "ms_per_token", "ms per generated token", f"decode: {what}", path)),
        "cache_plot": ("decode_cache_mb.png", lambda path: plot_against_n(
            report["rows"], styles, "cache_mb", "cache MB", f"cache after generate: {what}", path)),
    })
