"""Launching the runs of a comparison (:mod:`zoo.training.compare`): each run a separate process (``accelerate
launch`` or plain python) with its own config file and log beside its run folder; the failing process's error read
back from the log; ``--resume``'s reuse of a run folder that finished with the planned config.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from zoo.registry import get_variant_class
from zoo.training.compare_plan import Outcome, Run


def _placed(config: dict) -> dict:
    """A run config without its ``output_dir`` (the run folder's own path)."""
    return {key: value for key, value in config.items() if key != "output_dir"}


def command_for(run_config: Path, launcher: str | None) -> list[str]:
    if launcher:
        accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", launcher, "-m"]
        return [*accelerate, "zoo.training.finetune", str(run_config)]
    return [sys.executable, "-m", "zoo.training.finetune", str(run_config)]


def unavailable_reason(variant: str) -> str | None:
    """Why a variant cannot run here (not installed, broken plugin), or None. Checked without launching."""

    try:
        get_variant_class(variant)
    except Exception as exc:  # UnknownVariantError, BrokenVariantError, VariantConflictError
        return f"{type(exc).__name__}: {exc}"
    return None


def launch(run: Run, launcher: str | None, timeout_s: float, env: dict[str, str] | None = None) -> Outcome:
    """Run one fine-tune as its own process (``env``: variables added to this process's environment)."""
    reason = unavailable_reason(run.config.get("variant", "sdpa"))
    if reason:
        return Outcome("unavailable", reason)
    if run.run_dir.exists():
        shutil.rmtree(run.run_dir)
    run.run_dir.mkdir(parents=True)
    run_config = run.run_dir.parent / f"{run.run_dir.name}.yaml"
    run_config.write_text(yaml.safe_dump(run.config, sort_keys=False))
    log_path = run.run_dir.parent / f"{run.run_dir.name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command_for(run_config, launcher), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)  # the launcher and the training processes it started
            process.wait()
            return Outcome("timeout", f"stopped after {timeout_s / 60:.0f} minutes (timeout_minutes); log: {log_path}")
    results_path = run.run_dir / "results.json"  # the run folder was emptied above: this run wrote it
    if not results_path.is_file():
        return Outcome("failed", f"{last_error(log_path)} (exit code {returncode}; log: {log_path})")
    note = "" if returncode == 0 else f"exit code {returncode} after writing its results: {last_error(log_path)}"
    return Outcome("ok", note, results=json.loads(results_path.read_text()))


ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt))\b:?(.*)$")
WRAPPER_ERRORS = ("ChildFailedError", "CalledProcessError")
CRASH_LINE = re.compile(r"(Signal \d+ \(\w+\) received by PID \d+|terminate called .*|Killed|Segmentation fault.*)")
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?(.*)$")  # torchrun prefixes each worker's output lines
ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")


def last_error(log_path: Path) -> str:
    """The failing process's exception (``SomethingError: message``), else a crash line, else the log's last line.

    Under a launcher, the exception of the rank torchrun names as the root cause (or of the rank that raised first):
    the other ranks then fail only because they were stopped (``Signal 15 (SIGTERM)``) or lost their peer.
    """
    lines = log_path.read_text(errors="replace").splitlines()
    errors = []  # (rank or None, line) of every exception line, in log order
    for line in lines:
        match = RANK_PREFIX.match(line.strip())
        rank, text = (int(match.group(1)), match.group(2).strip()) if match else (None, line.strip())
        error = ERROR_LINE.match(text)
        if error and error.group(1) not in WRAPPER_ERRORS:
            errors.append((rank, text))
    if errors:
        rank = root_cause_rank(lines)
        if rank is None or all(r != rank for r, _ in errors):
            rank = errors[0][0]  # the first to raise
        text = [t for r, t in errors if r == rank][-1]
        return (text if rank is None else f"rank {rank}: {text}")[:500]
    for line in reversed(lines):
        crash = CRASH_LINE.search(line)
        if crash:
            return crash.group(1)[:500]
    tail = [line.strip() for line in lines if line.strip()]
    return tail[-1][:500] if tail else "no output"


def root_cause_rank(lines: list[str]) -> int | None:
    """The rank under torchrun's "Root Cause (first observed failure)" heading, if the log has one."""
    for i, line in enumerate(lines):
        if line.startswith("Root Cause"):
            for follow in lines[i + 1 : i + 8]:
                match = ROOT_CAUSE_RANK.match(follow)
                if match:
                    return int(match.group(1))
    return None


def reusable(run: Run) -> Outcome | None:
    """``--resume``: the outcome of a run folder that finished (results.json) with the planned config (the run's
    SEED.yaml beside it equals ``run.config`` but for ``output_dir``, which is where the folder lies: a comparison
    moved elsewhere, e.g. from docs/ to results/, resumes), else None (the run is launched again)."""
    results_path, run_config = run.run_dir / "results.json", run.run_dir.parent / f"{run.run_dir.name}.yaml"
    if not (results_path.is_file() and run_config.is_file()):
        return None
    try:
        saved = yaml.safe_load(run_config.read_text())
        if not isinstance(saved, dict) or _placed(saved) != _placed(run.config):
            return None
        return Outcome("ok", results=json.loads(results_path.read_text()))
    except (ValueError, yaml.YAMLError):
        return None
