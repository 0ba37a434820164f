"""``zoo bench``: the O(n²) wall, measured.

One self-attention layer with its q/k/v projections, for every registered variant and the peers, at each length:
median time over repeats after a warm-up, measured peak memory, achieved GFLOP/s against a dense-matmul roof
measured in the same run, and the error against the dense reference. Writes CSV, JSON, a markdown report and two
log-log plots.

Modules, each importing only those above it in this list:

- :mod:`~zoo.bench.contestants` -- what is measured: the shared q/k/v projections, a zoo variant as a layer;
- :mod:`~zoo.bench.peers` -- transformers' Longformer and BigBird, lucidrains' performer-pytorch and local-attention;
- :mod:`~zoo.bench.plan` -- settings, contestants chosen by name, cost models, extrapolation and what to skip;
- :mod:`~zoo.bench.measure` -- time, memory, error and roof measurements, each in a fresh process with a memory cap;
- :mod:`~zoo.bench.report` -- ratios and exponents, then CSV, JSON, markdown and plots (generic row helpers);
- :mod:`~zoo.bench.run` -- the loop over lengths and contestants;
- :mod:`~zoo.bench.timer` -- the one decode timer: contestants prefill once, then take turns decoding in rounds;
- :mod:`~zoo.bench.decode` -- ``zoo bench --decode``: per-token decode time and cache bytes against the prompt;
- the KV-cache benchmark (``python -m zoo.bench.kv``): :mod:`~zoo.bench.passkey` (the prompts),
  :mod:`~zoo.bench.kv_contestants`, :mod:`~zoo.bench.kv_accuracy`, :mod:`~zoo.bench.kv_memory`,
  :mod:`~zoo.bench.kv_decode`, :mod:`~zoo.bench.kv_report`;
- :mod:`~zoo.bench.cli` -- the ``zoo bench`` subcommand, its presets and flags, and ``python -m zoo.bench.kv``.
"""

from zoo.bench.cli import add_subcommand, cmd_bench, command_line, settings_from_args
from zoo.bench.contestants import Contestant, FailedContestant, QKVProjections, ZooContestant, merge_heads
from zoo.bench.measure import Runner, measure_error, measure_idle, measure_roof, measure_time
from zoo.bench.peers import PEERS, Peer
from zoo.bench.plan import (
    BenchSettings,
    History,
    available_memory_bytes,
    extrapolate,
    fit_exponent,
    make_contestants,
    parse_variant_params,
    registered_names,
    skip_reason,
    total_flops,
)
from zoo.bench.report import assemble_report, render_markdown, write_outputs
from zoo.bench.run import run_benchmark

__all__ = [
    "PEERS", "BenchSettings", "Contestant", "FailedContestant", "History", "Peer", "QKVProjections", "Runner",
    "ZooContestant", "add_subcommand", "assemble_report", "available_memory_bytes", "cmd_bench", "command_line",
    "extrapolate", "fit_exponent", "make_contestants", "measure_error", "measure_idle", "measure_roof",
    "measure_time", "merge_heads", "parse_variant_params", "registered_names", "render_markdown", "run_benchmark",
    "settings_from_args", "skip_reason", "total_flops", "write_outputs",
]
