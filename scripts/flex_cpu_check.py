"""CPU sanity check: compiled FlexAttention vs the chunked kernel of exact pattern variants, eval forward of the
attention core (projections excluded), at the given lengths; first-call (compile) and BlockMask build seconds apart.

    .venv/bin/python scripts/flex_cpu_check.py --variants longformer bigbird sparse_transformer --lengths 16384 32768
"""

import argparse
import functools
import resource
import time

import torch

from zoo.ops.backends import flex
from zoo.plug.backend import attention_backend
from zoo.plug.dispatch import run_variant
from zoo.registry import get_variant_class
from zoo.variant import AttentionCall


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(variant, n: int, args: argparse.Namespace) -> str:
    """One markdown row: best-of-``repeats`` seconds on each backend, the first Flex call and the mask build apart."""
    q, k, v = (torch.randn(1, args.heads, n, args.head_dim) for _ in range(3))
    call = AttentionCall(causal=False, scaling=args.head_dim**-0.5)
    attention = functools.partial(run_variant, variant, q, k, v, call)
    with torch.no_grad():
        pattern = variant.pattern(call, n, n)
        mask_s = seconds(functools.partial(flex.block_mask_for, pattern, call, 1, args.heads, n, "cpu"))
        with attention_backend("flex"):
            first = seconds(attention)
            flex_s = min(seconds(attention) for _ in range(args.repeats))
            out = attention()
        with attention_backend("chunked"):
            chunked_s = min(seconds(attention) for _ in range(args.repeats))
            diff = (attention() - out).abs().max().item()
    return (f"| {variant.name} | {n} | {chunked_s:.2f} | {flex_s:.2f} | {chunked_s / flex_s:.2f}x | {first:.1f} | "
            f"{mask_s:.2f} | {diff:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", default=["longformer", "bigbird", "sparse_transformer"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[16384])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print("| variant | n | chunked s | flex s | speed-up | first flex call s | BlockMask s | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.variants:
        for n in args.lengths:
            print(measure(get_variant_class(name)(), n, args), flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
