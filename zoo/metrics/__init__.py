"""``evaluate`` metric modules that ship with attention-zoo, so metrics load without the Hub."""

from __future__ import annotations

from pathlib import Path

import evaluate

METRICS_DIR = Path(__file__).parent


def load(name: str) -> evaluate.EvaluationModule:
    """``evaluate.load`` of a bundled module (``accuracy``, ``f1``), kept in memory.

    In memory because every process of a multi-process run computes the metric on the same gathered
    predictions; evaluate's default on-disk cache would have them write the same file.
    """
    path = METRICS_DIR / name / f"{name}.py"
    if not path.is_file():
        available = sorted(p.name for p in METRICS_DIR.iterdir() if (p / f"{p.name}.py").is_file())
        raise ValueError(f"attention-zoo bundles no metric {name!r}; available: {', '.join(available)}.")
    return evaluate.load(str(path), keep_in_memory=True)
