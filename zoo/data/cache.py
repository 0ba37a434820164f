"""Where attention-zoo keeps fetched corpora and built datasets, and the build-once cache for datasets."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import datasets

CACHE_ENV = "ATTENTION_ZOO_CACHE"


def cache_dir() -> Path:
    """``$ATTENTION_ZOO_CACHE``, else ``~/.cache/attention_zoo``."""
    path = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "attention_zoo")
    path.mkdir(parents=True, exist_ok=True)
    return path


def options_key(name: str, version: int, options: dict) -> str:
    """A directory name unique to one task, builder version and set of options."""
    digest = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{name}-v{version}-{digest}"


def cached_folder(kind: str, key: str, write: Callable[[Path], None]) -> Path:
    """``cache_dir()/kind/key``, written by ``write(folder)`` on first use (atomically: several processes may race)."""
    target = cache_dir() / kind / key
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{key}-"))
    try:
        write(staging)
        staging.rename(target)
    except OSError:  # another process finished first: keep its copy
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def cached_dataset(key: str, build: Callable[[], datasets.DatasetDict]) -> datasets.DatasetDict:
    """Load ``key`` from the cache, or build it and save it there."""
    target = cached_folder("datasets", key, lambda folder: build().save_to_disk(str(folder)))
    return datasets.load_from_disk(str(target))
