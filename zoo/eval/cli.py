"""``zoo eval CONFIG`` and ``python -m zoo.eval CONFIG``: run a long-context evaluation (:mod:`zoo.eval.run`)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from zoo.eval.config import load_config
from zoo.eval.report import write_eval_report
from zoo.eval.run import run
from zoo.eval.speed import measure

STAGES = ("answers", "perplexity", "speed", "kvpress", "report")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a zoo eval YAML config (recipes/configs/eval/*.yaml)")
    parser.add_argument("--output_dir", "--output-dir", dest="output_dir",
                        help="the run folder (default: the config's output_dir)")
    parser.add_argument("--dry_run", "--dry-run", dest="dry_run", action="store_true",
                        help="print the plan (tasks, samples, contestants); run nothing")
    parser.add_argument("--overwrite", action="store_true", help="delete the run folder first (default: resume it)")
    parser.add_argument("--stages", nargs="+", choices=STAGES,
                        help=f"run only these stages (default: {' '.join(STAGES)})")


def cmd_eval(args: argparse.Namespace) -> int:
    config = load_config(args.config, {"output_dir": args.output_dir})
    if args.overwrite and config.output_dir.exists() and not args.dry_run:
        shutil.rmtree(config.output_dir)
    out = run(config, resume=not args.overwrite, dry_run=args.dry_run, stages=tuple(args.stages or ()))
    if not args.dry_run and (out / "results.md").exists():
        print(f"zoo eval: report in {out / 'results.md'}")
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="long-context evaluation of a pretrained causal model (RULER-style "
                              "tasks, perplexity by position) with any variant, cache budget or saved model")
    add_arguments(p)
    p.set_defaults(func=cmd_eval)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_speed"]:  # one speed measurement, in the process run_speed started
        print(json.dumps(measure(json.loads(argv[1]))), flush=True)
        return 0
    if argv[:1] == ["_report"]:  # re-render a run folder's report
        print(write_eval_report(Path(argv[1])))
        return 0
    parser = argparse.ArgumentParser(prog="python -m zoo.eval", description=__doc__)
    add_arguments(parser)
    return cmd_eval(parser.parse_args(argv))
