"""Needle-in-a-haystack tasks: special magic numbers (or UUIDs) filed under keys, hidden in a haystack, asked for at
the end. ``niah_single`` hides one; ``niah_multikey`` adds needles of other keys; ``niah_multivalue`` files several
values under one key; ``niah_multiquery`` asks for the values of several keys.

As in RULER, a prompt that asks for one value (``niah_single``, ``niah_multikey``; ``niah_multivalue`` with one value,
``niah_multiquery`` with one query) speaks of it in the singular, in its header and question ("A special magic number
is hidden ... What is the special magic number for ..."); one that asks for several, in the plural. The needles say
"One of the special magic numbers for ..." either way.
"""

from __future__ import annotations

import random
import uuid

from zoo.eval.tasks.haystack import (
    HAYSTACKS,
    MIN_HAYSTACK,
    Prompt,
    adjective_noun,
    check_choice,
    check_count,
    encode,
    insert_needles,
    spread_depths,
    too_short_for_haystack,
)
from zoo.eval.tasks.haystack import haystack as make_haystack
from zoo.eval.tasks.registry import EvalTask, register

VALUES = ("number", "uuid")
KEYS = ("word", "number", "uuid")
HEADER_ONE = ("A special magic {kind} is hidden within the following text. Make sure to memorize it. I will quiz you "
              "about the {kind} afterwards.\n")
HEADER = ("Some special magic {kinds} are hidden within the following text. Make sure to memorize it. I will quiz "
          "you about the {kinds} afterwards.\n")
NEEDLE = "One of the special magic {kinds} for {key} is: {value}."
QUESTION_ONE = ("\nWhat is the special magic {kind} for {key} mentioned in the provided text? The special magic {kind} "
                "for {key} mentioned in the provided text is")
QUESTION_ALL = ("\nWhat are all the special magic {kinds} for {key} mentioned in the provided text? The special magic "
                "{kinds} for {key} mentioned in the provided text are")


def draw(rng: random.Random, kind: str) -> str:
    """A key or value of ``kind``: a 7-digit number, a UUID, or an adjective-noun pair of the Brown corpus."""
    if kind == "number":
        return str(rng.randrange(1_000_000, 10_000_000))
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return adjective_noun(rng)


def draw_distinct(rng: random.Random, kind: str, count: int, taken: set[str]) -> list[str]:
    """``count`` new strings of ``kind``, none in ``taken`` nor repeated (``taken`` grows with them)."""
    drawn = []
    for _ in range(1000 * count):
        if len(drawn) == count:
            break
        candidate = draw(rng, kind)
        if candidate not in taken:
            taken.add(candidate)
            drawn.append(candidate)
    if len(drawn) < count:
        raise ValueError(f"could not draw {count} distinct {kind}s")
    return drawn


def _check(task: str, haystack_kind: str, value: str, key: str) -> None:
    check_choice(task, "haystack", haystack_kind, HAYSTACKS)
    check_choice(task, "value", value, VALUES)
    check_choice(task, "key", key, KEYS)


def _listing(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]}"


def question(value_kind: str, keys: list[str], answers: list[str]) -> str:
    """The question for the values of ``keys``: in the singular when it asks for one value (RULER's rule)."""
    if len(answers) == 1:
        return QUESTION_ONE.format(kind=value_kind, key=_listing(keys))
    return QUESTION_ALL.format(kinds=value_kind + "s", key=_listing(keys))


def assemble(tokenizer, task: str, length: int, rng: random.Random, haystack_kind: str, value_kind: str,
             needles: list[tuple[float, str, str]], keys: list[str], answers: list[str],
             meta: dict | None = None) -> Prompt:
    """Header, the haystack with the needles (depth, key, value) inserted, the question for the values of ``keys``:
    exactly ``length`` ids; header and question in the singular when one value is asked for.

    The first needle's depth is the prompt's ``depth``.
    """
    kinds = value_kind + "s"
    header = HEADER_ONE.format(kind=value_kind) if len(answers) == 1 else HEADER.format(kinds=kinds)
    head = encode(tokenizer, header)
    pieces = [(depth, encode(tokenizer, " " + NEEDLE.format(kinds=kinds, key=key, value=value)))
              for depth, key, value in needles]
    asked = encode(tokenizer, question(value_kind, keys, answers))
    fixed = len(head) + sum(len(ids) for _, ids in pieces) + len(asked)
    room = length - fixed
    if room < MIN_HAYSTACK:
        raise too_short_for_haystack(task, length, fixed, "the header, needles and question")
    hay, where = make_haystack(tokenizer, haystack_kind, room, rng)
    body, offsets = insert_needles(tokenizer, hay, pieces)
    return Prompt(ids=head + body + asked, answers=answers, question_tokens=len(asked), depth=needles[0][0],
                  meta={**where, "value": value_kind, "needles": len(needles),
                        "needle_depths": [depth for depth, _, _ in needles],
                        "needle_offsets": [len(head) + offset for offset in offsets], **(meta or {})})


def niah_single(tokenizer, length: int, rng: random.Random, depth: float, *, haystack: str = "noise",
                value: str = "number", key: str = "word") -> Prompt:
    """One needle at ``depth``; the answer is its value."""
    _check("niah_single", haystack, value, key)
    taken: set[str] = set()
    (asked_key,) = draw_distinct(rng, key, 1, taken)
    (answer,) = draw_distinct(rng, value, 1, taken)
    return assemble(tokenizer, "niah_single", length, rng, haystack, value, [(depth, asked_key, answer)], [asked_key],
                    [answer], {"key": asked_key})


def niah_multikey(tokenizer, length: int, rng: random.Random, depth: float, *, haystack: str = "noise",
                  value: str = "number", key: str = "word", distractors: int = 3) -> Prompt:
    """The asked needle at ``depth`` and ``distractors`` needles of other keys and values at random depths."""
    _check("niah_multikey", haystack, value, key)
    check_count("niah_multikey", "distractors", distractors, 0)
    taken: set[str] = set()
    keys = draw_distinct(rng, key, 1 + distractors, taken)
    values = draw_distinct(rng, value, 1 + distractors, taken)
    depths = [depth, *spread_depths(rng, distractors)]
    needles = list(zip(depths, keys, values, strict=True))
    return assemble(tokenizer, "niah_multikey", length, rng, haystack, value, needles, keys[:1], [values[0]],
                    {"key": keys[0], "distractor_keys": keys[1:], "distractor_values": values[1:]})


def niah_multivalue(tokenizer, length: int, rng: random.Random, depth: float, *, haystack: str = "noise",
                    value: str = "number", key: str = "word", values: int = 4) -> Prompt:
    """``values`` needles of one key with different values (the first at ``depth``); the answer is every value."""
    _check("niah_multivalue", haystack, value, key)
    check_count("niah_multivalue", "values", values)
    taken: set[str] = set()
    (asked_key,) = draw_distinct(rng, key, 1, taken)
    answers = draw_distinct(rng, value, values, taken)
    depths = [depth, *spread_depths(rng, values - 1)]
    needles = [(d, asked_key, v) for d, v in zip(depths, answers, strict=True)]
    return assemble(tokenizer, "niah_multivalue", length, rng, haystack, value, needles, [asked_key], answers,
                    {"key": asked_key})


def niah_multiquery(tokenizer, length: int, rng: random.Random, depth: float, *, haystack: str = "noise",
                    value: str = "number", key: str = "word", queries: int = 4) -> Prompt:
    """``queries`` needles of different keys (the first at ``depth``); the question asks for every key's value."""
    _check("niah_multiquery", haystack, value, key)
    check_count("niah_multiquery", "queries", queries)
    taken: set[str] = set()
    keys = draw_distinct(rng, key, queries, taken)
    answers = draw_distinct(rng, value, queries, taken)
    depths = [depth, *spread_depths(rng, queries - 1)]
    needles = list(zip(depths, keys, answers, strict=True))
    return assemble(tokenizer, "niah_multiquery", length, rng, haystack, value, needles, keys, answers,
                    {"keys": keys})


register(*(EvalTask(build.__name__, build, depth=True)
            for build in (niah_single, niah_multikey, niah_multivalue, niah_multiquery)))
