"""``zoo bench`` on the command line: the arguments, the presets (``--quick``), the settings they make, and the run
spelled out as one explicit command for the report; and the KV-cache benchmark's ``python -m zoo.bench.kv``
(:func:`kv_main`).

Multi-word flags are spelled with underscores (``--output_dir``, the Hugging Face convention used by the
fine-tune and compare recipes too); the hyphenated spelling (``--output-dir``) is accepted as an alias.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from zoo.bench.contestants import FailedContestant
from zoo.bench.decode import (
    DECODE_LENGTHS,
    DecodeSettings,
    decode_contestants,
    run_decode_benchmark,
    write_decode_outputs,
)
from zoo.bench.kv_accuracy import run_accuracy
from zoo.bench.kv_contestants import MEMORY_ROWS, contestants
from zoo.bench.kv_decode import decode_smollm2, decode_tiny
from zoo.bench.kv_memory import measure_one, run_memory
from zoo.bench.kv_report import write_kv_report
from zoo.bench.passkey import write_prompts
from zoo.bench.plan import DEFAULT_LENGTHS, DTYPES, BenchSettings, make_contestants, parse_variant_params
from zoo.bench.report import write_outputs
from zoo.bench.run import run_benchmark
from zoo.cache import POLICIES
from zoo.plug.backend import attention_backend

QUICK = {"lengths": [512, 1024], "repeats": 1, "warmup": 1, "error_length": 512, "roof_size": 1024,
         "max_seconds": 20.0}
NORMAL = {"lengths": DEFAULT_LENGTHS, "repeats": 3, "warmup": 1, "error_length": 1024, "roof_size": 2048,
          "max_seconds": 120.0}


def number(kind: type, low: float, high: float | None = None, what: str = ""):
    """An argparse ``type`` accepting a ``kind`` number in [low, high) (``high`` None: no upper bound); argparse
    turns a refusal into ``argument --flag: ...`` and exit status 2 before anything runs."""
    word = {int: "an integer", float: "a number"}[kind]
    bounds = f">= {low:g}" if high is None else f"in [{low:g}, {high:g})"
    expected = f"{word} {bounds}{what}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not (value >= low and (high is None or value < high)):  # also refuses nan
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    parse.__name__ = f"{kind.__name__} {bounds}"  # argparse names the type in some messages
    return parse


POSITIVE = number(int, 1)
SECONDS = number(float, 1e-9, what=" (seconds)")


def add_flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """``--name_with_underscores``, with ``--name-with-hyphens`` accepted as an alias."""
    flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*flags, **kwargs)


def add_subcommand(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure time, memory, GFLOP/s and error of every variant and the peers against n",
        description="Measure time, peak memory, GFLOP/s and error of one attention layer with its q/k/v "
        "projections, for every registered variant and the peers, against the sequence length n. "
        "Multi-word flags also take hyphens (--output-dir = --output_dir).",
    )
    # what runs
    add_flag(p, "variants", nargs="+", help="variants and peers to run (default: all registered + peers)")
    add_flag(p, "variant_params", nargs="+", default=[], metavar="NAME.KEY=VALUE",
             help="override a parameter, e.g. longformer.window=256 hf_bigbird.num_random_blocks=2")
    add_flag(p, "lengths", nargs="+", type=POSITIVE, help=f"sequence lengths (default {DEFAULT_LENGTHS})")
    # the measured layer
    add_flag(p, "hidden", type=POSITIVE, help="hidden size (default 768; --decode: 256)")
    add_flag(p, "heads", type=POSITIVE, help="attention heads (default 12; --decode: 4)")
    add_flag(p, "batch", type=POSITIVE, default=1)
    add_flag(p, "dtype", choices=sorted(DTYPES), default="fp32")
    add_flag(p, "mode", choices=["fwd", "fwd+bwd"], default="fwd+bwd")
    add_flag(p, "causal", action="store_true", help="causal attention (the transformers peers are skipped)")
    add_flag(p, "dropout", type=number(float, 0.0, 1.0), default=0.0, metavar="P",
             help="attention dropout P: the layer runs in training mode; contestants without dropout are "
             "skipped with a note (default 0)")
    # how it is measured
    add_flag(p, "device", choices=["cpu", "cuda"], default="cpu")
    add_flag(p, "backend", choices=["auto", "flex", "chunked"], default="auto",
             help="exact pattern variants: FlexAttention, their chunked kernel, or auto (zoo.attention_backend)")
    add_flag(p, "threads", type=POSITIVE, default=None, help="torch threads (default: torch's default here)")
    add_flag(p, "repeats", type=POSITIVE,
             help="timed iterations per measurement (default 3; quick 1; --decode: rounds of --new_tokens tokens "
             "per contestant, default 8)")
    add_flag(p, "warmup", type=number(int, 0), help="untimed iterations first (default 1)")
    add_flag(p, "max_seconds", type=SECONDS,
             help="skip a combination whose estimated time for one iteration exceeds this (default 120)")
    add_flag(p, "error_length", type=POSITIVE, help="n at which the error against dense is measured (default 1024)")
    add_flag(p, "roof_size", type=POSITIVE, help="size of the square matmul measuring the roof (default 2048)")
    add_flag(p, "quick", action="store_true", help="n in {512, 1024}, one repeat: under a minute")
    # decoding
    add_flag(p, "decode", action="store_true",
             help="measure per-token decode latency and cache bytes of a tiny Llama through model.generate "
             f"against the prompt length (default lengths {DECODE_LENGTHS}), with transformers' SDPA and Mistral "
             "sliding-window caches as peers")
    add_flag(p, "new_tokens", type=number(int, 3, what=" (gaps between tokens are timed)"), default=32,
             help="--decode: tokens generated per contestant and round (default 32)")
    add_flag(p, "window", type=POSITIVE, default=512,
             help="--decode: keys a windowed contestant keeps (Mistral sliding_window, xformers window, causal "
             "longformer window/2 + 4 sink tokens; default 512)")
    # output
    add_flag(p, "output_dir", type=Path, help="default: runs/bench (--decode: runs/bench-decode)")
    add_flag(p, "no_progress", action="store_true")
    add_flag(p, "dry_run", action="store_true",
             help="check the flags and set up the contestants, print the run as one command, measure nothing "
             "(--device cuda is accepted without a GPU here)")
    p.set_defaults(func=cmd_bench)


def given(value, default):
    """The flag's value when it was given (0 included: the flag types refuse what cannot run), else the default."""
    return default if value is None else value


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    preset = QUICK if args.quick else NORMAL
    pick = {key: getattr(args, key) if getattr(args, key) is not None else preset[key] for key in preset}
    return BenchSettings(
        hidden=given(args.hidden, 768), heads=given(args.heads, 12), batch=args.batch, dtype=args.dtype,
        mode=args.mode, causal=args.causal, device=args.device, threads=given(args.threads, torch.get_num_threads()),
        dropout=args.dropout, **pick,
    )


def command_line(settings: BenchSettings, args: argparse.Namespace) -> str:
    """The run as one explicit command (every setting spelled out), for the report."""
    parts = ["zoo bench"]
    if args.variants:
        parts.append("--variants " + " ".join(args.variants))
    parts.append("--lengths " + " ".join(map(str, settings.lengths)))
    parts.append(f"--hidden {settings.hidden} --heads {settings.heads} --batch {settings.batch}")
    parts.append(f"--dtype {settings.dtype} --mode {settings.mode} --device {settings.device} --backend {args.backend}")
    parts.append(f"--threads {settings.threads} --repeats {settings.repeats} --warmup {settings.warmup}")
    parts.append(f"--max_seconds {settings.max_seconds:g} --error_length {settings.error_length} "
                 f"--roof_size {settings.roof_size}")
    if settings.causal:
        parts.append("--causal")
    if settings.dropout:
        parts.append(f"--dropout {settings.dropout:g}")
    if args.variant_params:
        parts.append("--variant_params " + " ".join(args.variant_params))
    parts.append(f"--output_dir {args.output_dir}")
    return " ".join(parts)


def decode_settings_from_args(args: argparse.Namespace) -> DecodeSettings:
    defaults = DecodeSettings()
    heads = given(args.heads, defaults.heads)
    return DecodeSettings(
        lengths=given(args.lengths, [512, 1024] if args.quick else defaults.lengths), new_tokens=args.new_tokens,
        rounds=given(args.repeats, 1 if args.quick else defaults.rounds),
        window=args.window, hidden=given(args.hidden, defaults.hidden), heads=heads,
        kv_heads=min(defaults.kv_heads, heads), batch=args.batch, device=args.device,
        threads=given(args.threads, torch.get_num_threads()), max_seconds=given(args.max_seconds, defaults.max_seconds),
    )


def decode_command_line(settings: DecodeSettings, args: argparse.Namespace) -> str:
    parts = ["zoo bench --decode"]
    if args.variants:
        parts.append("--variants " + " ".join(args.variants))
    parts.append("--lengths " + " ".join(map(str, settings.lengths)))
    parts.append(f"--new_tokens {settings.new_tokens} --repeats {settings.rounds} --window {settings.window}")
    parts.append(f"--hidden {settings.hidden}")
    parts.append(f"--heads {settings.heads} --batch {settings.batch} --threads {settings.threads}")
    parts.append(f"--backend {args.backend}")
    parts.append(f"--max_seconds {settings.max_seconds:g} --output_dir {args.output_dir}")
    return " ".join(parts)


def dry_run_done(command: str, names: list[str], broken: list[str]) -> int:
    """``--dry_run``'s report: 0 when every contestant could be set up, else 2 (what a real run would record as
    error rows)."""
    print(f"zoo bench --dry_run: would run {command}")
    print(f"zoo bench --dry_run: contestants {', '.join(names)}")
    for line in broken:
        print(f"zoo bench --dry_run: cannot set up {line}", file=sys.stderr)
    return 2 if broken else 0


def cmd_decode(args: argparse.Namespace) -> int:
    args.output_dir = args.output_dir or Path("runs/bench-decode")
    try:
        settings = decode_settings_from_args(args)
        settings.check()
        contestants = decode_contestants(args.variants, settings)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run_done(decode_command_line(settings, args), [c.name for c in contestants], [])
    with attention_backend(args.backend):
        report = run_decode_benchmark(settings, contestants, progress=not args.no_progress)
    paths = write_decode_outputs(report, args.output_dir, decode_command_line(settings, args))
    print(f"zoo bench --decode: wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.decode:
        return cmd_decode(args)
    args.output_dir = args.output_dir or Path("runs/bench")
    try:
        settings = settings_from_args(args)
        # a dry run checks every setting but the presence of the GPU it is prepared for
        (dataclasses.replace(settings, device="cpu") if args.dry_run else settings).check()
        contestants = make_contestants(args.variants, parse_variant_params(args.variant_params))
    except ValueError as exc:  # VariantParameterError included
        print(str(exc), file=sys.stderr)
        return 2
    if args.dry_run:
        broken = [f"{c.name}: {c.error}" for c in contestants if isinstance(c, FailedContestant)]
        return dry_run_done(command_line(settings, args), [c.name for c in contestants], broken)
    with attention_backend(args.backend):
        report = run_benchmark(settings, contestants, progress=not args.no_progress)
    paths = write_outputs(report, args.output_dir, command_line(settings, args))
    failed = sorted({r["variant"] for r in report["rows"] if r["status"] == "error"})
    print(f"zoo bench: wrote {', '.join(str(p) for p in paths.values())}")
    if failed:
        print(f"zoo bench: errors recorded for {', '.join(failed)} (see the note column)")
    return 0


# ---------------------------------------------------------------------------------------------------
# python -m zoo.bench.kv


KV_DESCRIPTION = "Passkey retrieval on a real pretrained model (SmolLM2-135M-Instruct) with a bounded KV cache"


def kv_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zoo.bench.kv", description=KV_DESCRIPTION)
    parser.add_argument("command", choices=["prompts", "accuracy", "memory", "decode", "report"])
    parser.add_argument("--out", type=Path, default=Path("results/bench/kv"))
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
    return parser


def kv_main(argv: list[str] | None = None) -> int:
    """``python -m zoo.bench.kv COMMAND ...`` (``_measure SETTING``: one memory row, in the process it starts)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_measure":
        print(json.dumps(measure_one(json.loads(argv[1]))))
        return 0
    args = kv_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    timing = {"tokens": args.tokens, "new_tokens": max(args.new_tokens, 8), "rounds": args.rounds,
              "chunk": args.chunk, "threads": args.threads}
    if args.command == "prompts":
        print(write_prompts(args.out, args.contexts, args.depths, args.keys))
    elif args.command == "accuracy":
        chosen = [c for c in contestants(args.budgets, args.policies, quantized=not args.no_quantized)
                  if not args.only or c["family"] in args.only]
        run_accuracy(args.out, args.contexts, chosen, shared=args.shared, batch=args.batch,
                     keys_per_depth=args.keys_per_depth, chunk=args.chunk, threads=args.threads)
    elif args.command == "decode":
        (decode_smollm2 if args.model == "smollm2" else decode_tiny)(args.out, args.contexts, **timing)
    elif args.command == "memory":
        run_memory(args.out, args.contexts, args.rows, tokens=args.tokens, new_tokens=args.new_tokens,
                   chunk=args.chunk or 512, threads=args.threads, env=args.env, trim=args.trim,
                   warmup=not args.no_warmup, timeout=args.timeout)
    else:
        paths = write_kv_report(args.out)
        print(f"wrote {paths['markdown']} and {paths['plot']}")
    return 0
