"""``zoo bench --decode``: per-token decode latency and cache bytes against the prompt length.

A tiny Llama (hidden 256, 4 heads, 2 layers, fp32, batch 1 by default) generates ``new_tokens`` greedy tokens
through ``model.generate`` after a random prompt of n tokens, once per (contestant, n), each in a fresh process
with a memory cap (:class:`zoo.bench.measure.Runner`). The time per token is the median gap between the time
stamps a streamer records as tokens arrive (the first token, which carries the prefill, is left out: prefill noise
would swamp the difference); the cache bytes are those of the cache object ``generate`` returns (``zoo.cache_nbytes``).

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
from pathlib import Path
from typing import Any

import torch

from zoo.bench.measure import Runner, measure_idle
from zoo.bench.plan import History, extrapolate
from zoo.bench.report import errors_section, grid, machine_info, plot_against_n
from zoo.cache import cache_nbytes
from zoo.plug.install import configure
from zoo.plug.spec import variant_for
from zoo.registry import get_variant_class, list_variants
from zoo.reporting import MB, fixed, human_bytes, markdown_table, write_csv
from zoo.training.lm import TokenClock

DECODE_LENGTHS = [2048, 8192, 32768, 131072]
SINK_TOKENS = [0, 1, 2, 3]
PEERS = ("transformers_sdpa", "mistral_sliding_window")
QUADRATIC_PREFILL = {"transformers_sdpa", "mistral_sliding_window", "sdpa", "dense"}


@dataclass
class DecodeSettings:
    lengths: list[int] = field(default_factory=lambda: list(DECODE_LENGTHS))
    new_tokens: int = 32
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
        num_key_value_heads=settings.kv_heads, max_position_embeddings=n + settings.new_tokens + 64,
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


def measure_decode(contestant: DecodeContestant, settings: DecodeSettings, n: int) -> dict[str, Any]:
    model = build_model(contestant, settings, n)
    generator = torch.Generator().manual_seed(n)
    prompt = torch.randint(3, settings.vocab, (settings.batch, n), generator=generator)
    greedy = dict(do_sample=False, pad_token_id=0)
    clock = TokenClock()
    with torch.inference_mode():
        model.generate(prompt[:, :64], max_new_tokens=4, min_new_tokens=4, **greedy)  # first-call overheads
        start = time.perf_counter()
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=settings.new_tokens,
            min_new_tokens=settings.new_tokens, streamer=clock, return_dict_in_generate=True, **greedy,
        )
    gaps = clock.token_gaps()
    return {
        "status": "ok",
        "ms_per_token": 1e3 * statistics.median(gaps),
        "ms_per_token_min": 1e3 * min(gaps),
        "first_token_s": clock.stamps[1] - start,
        "cache_bytes": cache_nbytes(out.cache),
        "cache_class": type(out.cache).__name__,
    }


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


def run_decode_benchmark(settings: DecodeSettings, contestants: list[DecodeContestant],
                         progress: bool = True) -> dict[str, Any]:
    from tqdm.auto import tqdm

    runner = Runner(settings, [])
    runner.run(measure_idle, timeout=120)  # starts the forkserver before anything is timed
    histories = {c.name: History() for c in contestants}
    refusals = {c.name: cache_refusal(c, settings) for c in contestants}
    rows = []
    bar = tqdm(total=len(contestants) * len(settings.lengths), disable=not progress, desc="zoo bench --decode")
    for n in settings.lengths:
        for contestant in contestants:
            bar.set_postfix_str(f"{contestant.name} n={n}")
            history = histories[contestant.name]
            refusal = refusals[contestant.name]
            note = f"skipped: {refusal}" if refusal else _skip_note(contestant, settings, n, history)
            if note:
                rows.append(_row(contestant, n, status="skipped", note=note))
            else:
                started = time.perf_counter()
                result = runner.run(measure_decode, contestant, settings, n, timeout=60 + 3 * settings.max_seconds)
                if result["status"] == "ok":
                    history.times.append((n, time.perf_counter() - started))
                    rows.append(_row(contestant, n, ms_per_token=result["ms_per_token"],
                                     ms_per_token_min=result["ms_per_token_min"],
                                     first_token_s=result["first_token_s"], cache_mb=result["cache_bytes"] / MB,
                                     cache_class=result["cache_class"]))
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


CSV_FIELDS = ["variant", "kind", "n", "status", "ms_per_token", "ms_per_token_min", "first_token_s", "cache_mb",
              "cache_class", "note"]


def _ok(rows: list[dict[str, Any]], name: str, n: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["variant"] == name and r["n"] == n and r["status"] == "ok"), None)


def _versus_table(report: dict[str, Any], peer: str) -> list[str]:
    """Per length: how many times faster per token than ``peer``, and the fraction of its cache bytes."""
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
                cells.append(f"{theirs['ms_per_token'] / mine['ms_per_token']:.1f}x, "
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
        f"{s['vocab']}, fp32, batch {s['batch']}; greedy `model.generate` of {s['new_tokens']} tokens after an "
        f"n-token prompt; time per token = median gap between a streamer's time stamps (first token excluded); "
        f"cache = bytes of the tensors in the cache `generate` returns. Window {s['window']} keys. "
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
    ]
    for peer in PEERS:
        if peer in report["contestants"]:
            lines += [*_versus_table(report, peer), ""]
    lines += ["## Growth with the prompt", "", *_growth_table(report), "", "## Errors", "",
              *errors_section(report["rows"]), ""]
    return "\n".join(lines)


def write_decode_outputs(report: dict[str, Any], output_dir: Path, command: str) -> dict[str, Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "csv": output_dir / "decode.csv",
        "json": output_dir / "decode.json",
        "markdown": output_dir / "decode.md",
        "time_plot": output_dir / "decode_ms_per_token.png",
        "cache_plot": output_dir / "decode_cache_mb.png",
    }
    write_csv(paths["csv"], report["rows"], CSV_FIELDS)
    paths["json"].write_text(json.dumps({**report, "command": command}, indent=2, default=str))
    paths["markdown"].write_text(render_markdown(report, command))
    styles = {name: "--" if info["kind"] == "peer" else "-" for name, info in report["contestants"].items()}
    s = report["settings"]
    what = f"tiny Llama (hidden {s['hidden']}, {s['layers']} layers), greedy generate, {s['device']}"
    plot_against_n(report["rows"], styles, "ms_per_token", "ms per generated token", f"decode: {what}",
                   paths["time_plot"])
    plot_against_n(report["rows"], styles, "cache_mb", "cache MB", f"cache after generate: {what}",
                   paths["cache_plot"])
    return paths

