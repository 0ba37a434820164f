"""Small pieces every report of the zoo shares (``zoo bench``, ``zoo eval``, ``zoo.training.compare``, the retrofit,
model cards): number formats, markdown tables, CSV and JSON-lines files, paths relative to a run folder, matplotlib
set up for files, and peak-memory readings.

No zoo imports here and only the standard library at the top: any module may use it, and
``scripts/kvpress_peer.py`` loads this file by its path from an environment without the zoo. torch and matplotlib
are imported only by the functions that need them.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import resource
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

MB = 2**20
NONE = "–"  # what a table shows for a value that was not measured
REPOSITORY = Path(__file__).resolve().parents[1]  # the checkout (records name paths relative to it or their folder)


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
    """An exception as one line for a table: ``TypeName: first line of the message`` (files of the checkout named
    relative to it)."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__
    return text.replace(f"{REPOSITORY}{os.sep}", "")[:limit]


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


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON lines of ``path``: [] when it does not exist; a line cut short by an interrupted run is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            if line.strip():
                rows.append(json.loads(line))
    return rows


def append_jsonl(path: str | Path, row: dict) -> None:
    """Append ``row`` as one JSON line (after a newline when the file ends without one: a line cut short)."""
    path = Path(path)
    lead = "\n" if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n") else ""
    with path.open("a") as handle:
        handle.write(lead + json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------------------
# paths


def relative_path(path: str | Path, folder: str | Path, root: str | Path | None = None) -> str:
    """``path`` as a record names it: relative to the run ``folder`` when it lies inside it, else relative to
    ``root`` (default: the repository, this file's grandparent) when it lies there, else as given (absolute).

    Args:
        path: the path to record (absolute or relative to the working directory).
        folder: the folder of the record that names it (its run folder).
        root: the second anchor; default the repository root.
    """
    target = Path(os.path.abspath(path))
    for anchor in (folder, REPOSITORY if root is None else root):
        anchor = Path(os.path.abspath(anchor))
        if target == anchor or anchor in target.parents:
            return target.relative_to(anchor).as_posix() or "."
    return str(path)


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
    return rusage_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def rusage_bytes(maxrss: int) -> int:
    """``ru_maxrss`` in bytes: macOS reports bytes, Linux (and the other systems) KiB."""
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def reset_peak_rss() -> None:
    """Start this process's peak RSS afresh where the system allows (Linux): Linux carries the parent's high-water
    mark across fork and exec, so a process started by a large one reports the parent's peak
    (``echo 5 > /proc/self/clear_refs`` resets it). Elsewhere nothing changes."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """This process's peak RSS since :func:`reset_peak_rss` (Linux's ``VmHWM``; elsewhere :func:`max_rss_bytes`)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return max_rss_bytes()


def peak_memory_bytes() -> int:
    """The peak memory a run of this process used: the CUDA peak allocation when a GPU is there, else max RSS."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return max_rss_bytes()
