"""Committed records name no machine: no file under ``results/`` or ``docs/`` holds an absolute path of the machine
it was made on (a temporary folder, a home folder, a checkout); records name paths relative to their folder or to the
repository. URLs are allowed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# an absolute path: not preceded by a letter, digit, ':' or '/' (URLs and relative paths pass)
MACHINE_PATH = re.compile(r"(?<![\w:/.~-])/(?:tmp|home|root|work|Users|private/var|var/folders)/")


def committed(*folders: str) -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", *folders], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed.stdout.splitlines()]


def machine_paths(text: str) -> list[str]:
    return [text[m.start():m.start() + 60].split()[0] for m in MACHINE_PATH.finditer(text)]


def test_the_pattern_finds_paths_and_spares_urls():
    assert machine_paths('"output_dir": "/tmp/rt/win/all/stage2"') == ['/tmp/rt/win/all/stage2"']
    assert machine_paths("rootdir: /work/main") == ["/work/main"]
    assert machine_paths("/Users/me/x and /private/var/folders/ab") == ["/Users/me/x", "/private/var/folders/ab"]
    assert not machine_paths("https://example.org/home/page and runs/tmp/seed0 and ~/.cache/x and file:///tmp/a")


def test_no_committed_record_names_an_absolute_path():
    found = {}
    for path in committed("results", "docs"):
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # pictures and other binary files
            continue
        if hits := machine_paths(text):
            found[str(path.relative_to(ROOT))] = hits[:3]
    assert not found, f"records naming absolute paths (write them relative to their folder or the repository): {found}"
