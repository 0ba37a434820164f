"""Test setup: no Hub, and the third-party plugin fixture installed (with pip, into a private target
directory put on sys.path) before the registry looks for entry points."""

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PLUGIN_SRC = Path(__file__).parent / "plugin_fixture"


def install_plugin_fixture(source: Path, package: str) -> Path:
    """pip-install the fixture package at ``source`` into a private folder (once per content) and return it."""
    digest = hashlib.sha256()
    for path in sorted(source.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path):
            digest.update(path.read_bytes())
    target = Path(tempfile.gettempdir()) / f"attention-zoo-{source.name}-{digest.hexdigest()[:12]}"
    if not (target / package).exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
             "--target", str(target), str(source)],
            check=True,
        )
    return target


PLUGIN_TARGET = install_plugin_fixture(PLUGIN_SRC, "zoo_chunked_plugin")
sys.path.insert(0, str(PLUGIN_TARGET))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN_TARGET), os.environ.get("PYTHONPATH")]))
