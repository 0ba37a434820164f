"""Passkey retrieval on a real pretrained model (SmolLM2-135M-Instruct, :mod:`zoo.data.pretrained`) with a bounded KV
cache: the ``budget`` variant under each policy, against transformers' full cache, the zoo ``longformer`` window with
4 sinks, transformers' ``QuantizedCache`` (quanto) and, from a second environment, NVIDIA kvpress
(scripts/kvpress_peer.py, reading the prompts this benchmark writes).

    python -m zoo.bench.kv prompts  --contexts 1024 2048 --depths 0.1 0.5 0.9 --keys 2 --out results/bench/kv
    python -m zoo.bench.kv accuracy --contexts 1024 --budgets 0.5 0.25 0.1 --out results/bench/kv
    python -m zoo.bench.kv memory   --contexts 2048 8192 --tokens 512 --out results/bench/kv  # RSS, bytes, ms/token
    python -m zoo.bench.kv report   --out results/bench/kv                                   # kv.md and kv.png

The accuracy part is also a ``zoo eval`` config (``zoo eval recipes/configs/eval/passkey.yaml``: the same passkey
prompts, scored with intervals and reported as every eval task, with the same decode timer and report writer); this
entry keeps the memory diagnosis and the tiny-model decode rows.

The entry point only; the pieces live beside it: the prompts in :mod:`zoo.bench.passkey`, the contestants in
:mod:`zoo.bench.kv_contestants`, the accuracy table in :mod:`zoo.bench.kv_accuracy`, peak RSS in
:mod:`zoo.bench.kv_memory`, decode time in :mod:`zoo.bench.kv_decode` (the timer of :mod:`zoo.bench.timer`), the
report in :mod:`zoo.bench.kv_report` and the arguments in :func:`zoo.bench.cli.kv_main`.
"""

from __future__ import annotations

import sys

from zoo.bench.cli import kv_main as main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
