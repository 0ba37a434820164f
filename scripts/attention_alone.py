"""Time variants' attention alone (no projections) against SDPA, forward + backward, and list where the time goes.

The benchmark (`zoo bench`) times one layer with its q/k/v projections, whose cost is the same for every variant and
caps the ratios; this times the kernels alone (variants without learned per-layer weights: `moba`, the patterns) on
random q/k/v (1, heads, n, head_dim) fp32, causal, best of ``--repeats`` after one warm-up, the variants taking turns,
then one profiled step per variant (torch.profiler, the operators of largest own time). The run in
docs/guides/which-variant.md:

    .venv/bin/python scripts/attention_alone.py --variants moba --length 16384 --threads 2 --rows 8
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import profile

from zoo.call import AttentionCall
from zoo.registry import get_variant_class
from zoo.variant import Variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["moba"],
                        help="zoo variants without learned weights, at their defaults")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=12, help="profiler rows per variant (0: no profile)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.length, args.head_dim, requires_grad=True) for _ in range(3))
    call = AttentionCall(causal=True, scaling=args.head_dim**-0.5, training=True)
    steps = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    for name in args.variants:
        variant = get_variant_class(name)()
        if type(variant).make_module is not Variant.make_module:  # nsa, dsa: their weights read the hidden states
            parser.error(f"{name} has learned per-layer weights that need a model around it; time it with zoo bench.")
        steps[name] = lambda variant=variant: variant.attend(q, k, v, call)

    def run(step) -> float:
        start = time.perf_counter()
        step().sum().backward()
        return time.perf_counter() - start

    for step in steps.values():
        run(step)  # warm-up
    best = {name: min(run(step) for _ in range(args.repeats)) for name, step in steps.items()}
    for name, seconds in best.items():
        print(f"{name}: {seconds:.3f} s ({best['sdpa'] / seconds:.2f}x sdpa's speed)")
    for name, step in steps.items():
        if args.rows and name != "sdpa":
            with profile() as profiled:
                run(step)
            print(f"\n{name}:\n" + profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
