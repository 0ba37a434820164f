"""The shared report helpers of :mod:`zoo.reporting`: JSON lines, peak memory on Linux and macOS, and the paths a
record names (relative to its run folder or the repository)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from zoo import reporting


def test_json_lines_append_and_read_back_past_a_line_cut_short(tmp_path):
    path = tmp_path / "rows.jsonl"
    assert reporting.read_jsonl(path) == []
    reporting.append_jsonl(path, {"a": 1})
    with path.open("a") as handle:
        handle.write('{"cut": ')  # an interrupted run
    reporting.append_jsonl(path, {"b": [2, 3]})
    assert reporting.read_jsonl(path) == [{"a": 1}, {"b": [2, 3]}]
    assert path.read_text().splitlines()[0] == json.dumps({"a": 1})


def test_ru_maxrss_is_kib_on_linux_and_bytes_on_macos(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert reporting.rusage_bytes(1000) == 1000 * 1024
    monkeypatch.setattr(sys, "platform", "darwin")
    assert reporting.rusage_bytes(1000) == 1000


def test_peak_memory_readings_are_in_bytes():
    peak, rss = reporting.peak_rss_bytes(), reporting.max_rss_bytes()
    assert peak > 2**20 and rss > 2**20  # a Python process holds more than a megabyte
    assert peak <= rss * 1.5 + 2**26  # the same unit: not off by a factor of 1024


def test_paths_are_named_relative_to_the_run_folder_or_the_repository(tmp_path):
    run = tmp_path / "out" / "run"
    assert reporting.relative_path(run / "stage1" / "model", run) == "stage1/model"
    assert reporting.relative_path(run, run) == "."
    assert reporting.relative_path(tmp_path / "out" / "other", run, root=tmp_path) == "out/other"
    repo = reporting.REPOSITORY
    assert reporting.relative_path(repo / "results" / "x.csv", run) == "results/x.csv"
    elsewhere = Path("/somewhere/else")
    assert reporting.relative_path(elsewhere, run, root=tmp_path) == str(elsewhere)  # neither: kept absolute
