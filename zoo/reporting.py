"""Small pieces every report of the zoo shares (``zoo bench``, ``zoo.training.compare``, model cards): number formats,
markdown tables and CSV files, matplotlib set up for files, and peak-memory readings.

No zoo imports here: any module may use it. torch and matplotlib are imported only by the functions that need them.
"""

from __future__ import annotations

import csv
import resource
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

MB = 2**20
NONE = "–"  # what a table shows for a value that was not measured


# ---------------------------------------------------------------------------------------------------
# numbers and text


def fixed(value: float | None, digits: int = 2, *, grouping: bool = False, none: str = NONE) -> str:
    """``digits`` decimals while the value has fewer than ``digits`` integer digits, a whole number after:
    ``fixed(0.01234) == "0.01"``, ``fixed(3.14159, 3) == "3.142"``, ``fixed(1234.5) == "1234"``
    (``"1,234"`` with ``grouping``)."""
    if value is None:
        return none
    if abs(value) < 10**digits:
        return f"{value:,.{digits}f}" if grouping else f"{value:.{digits}f}"
    return f"{value:,.0f}" if grouping else f"{value:.0f}"


def significant(value: Any, none: str = "?") -> str:
    """Any value for a table cell: a float with 4 significant digits (whole and grouped from 1000 on), anything
    else as ``str``."""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return none if value is None else str(value)


def describe_error(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line for a table: ``TypeName: first line of the message``."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__
    return text[:limit]


def human_bytes(value: float) -> str:
    """``1.5 GB``, ``953.7 MB``, ``12 KB`` (binary units)."""
    for unit, scale in (("TB", 2**40), ("GB", 2**30), ("MB", 2**20)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value / 2**10:.0f} KB"


# ---------------------------------------------------------------------------------------------------
# tables


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> list[str]:
    """A markdown table as lines. ``align``: one letter per column, ``l`` (default) or ``r``."""
    align = align or "l" * len(header)
    if len(align) != len(header):
        raise ValueError(f"markdown_table: {len(header)} columns but alignment {align!r}")
    rule = "".join("|---:" if a == "r" else "|---" for a in align) + "|"
    return [_markdown_row(header), rule, *(_markdown_row(row) for row in rows)]


def _markdown_row(cells: Sequence[Any]) -> str:
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def write_csv(path: str | Path, rows: Iterable[dict[str, Any]], fields: Sequence[str]) -> None:
    """One CSV line per row with the columns ``fields`` in that order (other keys of a row are left out)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(fields), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# ---------------------------------------------------------------------------------------------------
# plots


def pyplot():
    """``matplotlib.pyplot`` drawing to files only (the Agg backend: no display needed, safe in subprocesses)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 120) -> None:
    """Lay out, write and close ``fig`` (an open figure keeps its memory until closed)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, bbox_inches="tight")  # legends outside the axes stay in the picture
    pyplot().close(fig)


# ---------------------------------------------------------------------------------------------------
# memory


def max_rss_bytes() -> int:
    """Peak resident memory of this process so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_memory_bytes() -> int:
    """The peak memory a run of this process used: the CUDA peak allocation when a GPU is there, else max RSS."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return max_rss_bytes()
