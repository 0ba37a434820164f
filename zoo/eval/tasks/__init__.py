"""The tasks of ``zoo eval``: RULER-style synthetic long-context prompts (Hsieh et al. 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?"), written anew for the zoo, plus the benchmark's passkey.

:func:`make_samples` draws ``count`` :class:`Sample` s of one task at one length: exactly ``length`` token ids each,
the context first and the question with its answer prefix as the last ``question_tokens`` ids. Every sample is
drawn from its own seed (from the run's seed, the task's label, the length and the sample's number), so a sample is
the same whatever else the run holds. Tasks (their options and defaults: :func:`task_options`):

- ``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``niah_multiquery`` (:mod:`.niah`),
- ``variable_tracking`` (:mod:`.tracking`), ``common_words`` and ``frequent_words`` (:mod:`.words`),
- ``passkey`` (:mod:`.passkey`).

Each task module registers its tasks (:class:`~.registry.EvalTask`: the builder, whether it puts a needle at a
depth, its answer budget) when imported; a new task is a module of its own, imported below.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from zoo.eval.tasks import niah, passkey, tracking, words  # noqa: F401  (each registers its tasks)
from zoo.eval.tasks.haystack import Prompt, TooShortError
from zoo.eval.tasks.registry import REGISTRY, EvalTask, register

TASKS: Mapping[str, EvalTask] = MappingProxyType(REGISTRY)  # every registered task by name (read only)
# Probe samples behind :func:`minimum_length`.
PROBES = 64


@dataclass
class Sample:
    """One prompt of a task at a length, and what a correct answer holds."""

    task: str  # the task's label in the run (default: the task's name)
    length: int  # tokens (RULER's own tasks: the length asked for, which prompt and answer budget fit in)
    index: int  # the sample's number within (task, length)
    seed: int  # the seed it was drawn from (:func:`sample_seed`)
    ids: list[int]  # the zoo's tasks: exactly `length` ids, context first, question and answer prefix last
    answers: list[str]  # the expected strings
    question_tokens: int  # how many of the last ids are the question and answer prefix
    new_tokens: int  # tokens to generate greedily (the same for every sample of one make_samples call)
    depth: float | None = None  # where the (first) needle sits, 0..1 of the haystack, for needle tasks
    meta: dict = field(default_factory=dict)  # the task's name, its options, where its parts sit ...

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, row: dict) -> Sample:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in row.items() if name in names})


def sample_seed(seed: int, label: str, length: int, index: int) -> int:
    """A 63-bit seed from the run's seed, the task's label, the length and the sample's number (stable across
    processes and Python versions, unlike ``hash``)."""
    digest = hashlib.sha256(f"{seed}/{label}/{length}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _task(task: str) -> EvalTask:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}.")
    return TASKS[task]


def _builder(task: str) -> Callable[..., Prompt]:
    return _task(task).build


def task_options(task: str) -> dict[str, Any]:
    """``{option: default}`` of ``task`` (``common_words``'s ``common_freq`` None: scaled with the length)."""
    signature = inspect.signature(_builder(task))
    return {name: p.default for name, p in signature.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _resolve(task: str, options: dict[str, Any]) -> dict[str, Any]:
    known = task_options(task)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{task}: unknown option(s) {', '.join(unknown)}; the options of {task} are: "
                         f"{', '.join(f'{k} (default {v!r})' for k, v in known.items()) or 'none'}.")
    return {**known, **options}


def answer_tokens(tokenizer, task: str, answers: list[str]) -> int:
    """Tokens enough for a greedy answer naming every expected string (:meth:`EvalTask.answer_tokens`: the longest
    of the answers' forms, a comma list, a numbered list for several answers or the task's own, plus a fifth, at
    least 4 tokens)."""
    return _task(task).answer_tokens(tokenizer, answers)


def _least(tokenizer, task: str, build: Callable[..., Prompt], rng: random.Random, options: dict[str, Any]) -> int:
    """The least length of the sample ``rng`` draws (its keys and values change it by a few tokens)."""
    try:
        build(tokenizer, 0, rng, 0.5, **options)
    except TooShortError as error:
        return error.minimum
    raise RuntimeError(f"{task}: a prompt of length 0 was built")


def minimum_length(tokenizer, task: str, **options) -> int:
    """A length that holds the task's fixed parts for any seed, in practice: the most of ``PROBES`` probe samples
    plus 8 tokens, rounded up to a multiple of 16 (the keys and values drawn change the need by a few tokens)."""
    build, resolved = _builder(task), _resolve(task, options)
    most = max(_least(tokenizer, task, build, random.Random(probe), resolved) for probe in range(PROBES))
    return -(-(most + 8) // 16) * 16


def _depths(task: str, count: int, depths: list[float] | None) -> list[float | None]:
    if not _task(task).depth:
        return [None] * count
    if depths is None:
        return [(i + 0.5) / count for i in range(count)]
    if not depths or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1 for d in depths):
        raise ValueError(f"{task}: depths={depths!r}; give numbers from 0 to 1 (or none: spread evenly).")
    return [float(depths[i % len(depths)]) for i in range(count)]


def make_samples(tokenizer, task: str, length: int, count: int, *, seed: int = 0, label: str | None = None,
                 depths: list[float] | None = None, **options) -> list[Sample]:
    """``count`` samples of ``task`` at ``length`` tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (only ``tokenizer(text, add_special_tokens=False)`` and decoding used).
        task: a name of :data:`TASKS`.
        length: tokens per prompt.
        count: samples to draw.
        seed: the run's seed.
        label: the task's label in the run (seeds and ``Sample.task``); default the task's name.
        depths: for needle tasks, where the first needle sits (cycled over the samples); default
            ``(i + 0.5) / count`` for sample ``i``.
        **options: the task's options (:func:`task_options`).

    Returns:
        The samples; all of them have the ``new_tokens`` of the one needing the most.

    Raises:
        ValueError: an unknown task or option, a bad option value, or a length below the task's minimum.
    """
    build, resolved = _builder(task), _resolve(task, options)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"{task}: length={length!r}; use a positive whole number of tokens.")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"{task}: count={count!r}; use a whole number >= 0.")
    label = label or task
    samples = []
    for index, depth in enumerate(_depths(task, count, depths)):
        seed_here = sample_seed(seed, label, length, index)
        try:
            prompt = build(tokenizer, length, random.Random(seed_here), depth, **resolved)
        except TooShortError as error:
            least = max(error.minimum, minimum_length(tokenizer, task, **options))
            name = task if label == task else f"{label} ({task})"
            raise TooShortError(f"{name}: length {length} is too short: {error.detail}; use a length of at least "
                                f"{least} tokens.", least, error.detail) from None
        if len(prompt.ids) != length:  # a bug, never the config's fault
            raise RuntimeError(f"{task}: built {len(prompt.ids)} ids for length {length}")
        samples.append(Sample(task=label, length=length, index=index, seed=seed_here, ids=prompt.ids,
                              answers=prompt.answers, question_tokens=prompt.question_tokens, new_tokens=0,
                              depth=prompt.depth, meta={"task": task, "options": resolved, **prompt.meta}))
    new_tokens = max((answer_tokens(tokenizer, task, s.answers) for s in samples), default=0)
    for sample in samples:
        sample.new_tokens = new_tokens
    return samples


__all__ = ["TASKS", "EvalTask", "Prompt", "Sample", "TooShortError", "answer_tokens", "make_samples", "minimum_length",
           "register", "sample_seed", "task_options"]
