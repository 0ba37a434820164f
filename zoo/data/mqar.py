"""Multi-query associative recall (MQAR), generated locally by seed, as in Zoology (Arora et al. 2023).

Each sequence opens with ``num_kv_pairs`` key-value pairs (keys from the first half of the vocabulary, token 0
excluded; values from the second half); then every key comes back once as a query, at a gap drawn from the
power law p(g) ~ a * g^(a - 1) over the ``(seq_len - 2 * pairs) / 2`` even slots after the pairs (``power_a`` = 0.01:
most queries come soon after the pairs, a few far). The model must output the key's value right after the query.
Every other position holds a random token of the whole vocabulary (``random_non_queries``), as Zoology's code does.

Causal-LM format (Hugging Face's: the model shifts the labels itself): ``input_ids`` (``seq_len`` tokens),
``labels`` (-100 everywhere except the position after each query, which holds its value) and ``distance``
(-1 except at those positions: how many tokens before the query its key stands, query position - key position:
what a window must reach). The test and validation splits are drawn from their own random streams, and any
sequence also drawn for training is removed from them.
"""

from __future__ import annotations

import datasets
import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from zoo.data.labels import IGNORE_INDEX, NO_DISTANCE

SOURCE = "generated locally (Zoology's multi-query associative recall)"
PAD = "<pad>"
SPLIT_STREAMS = {"train": 0, "validation": 1, "test": 2}  # child random streams of the seed, one per split


def tokenizer(vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Token ``i`` is the text ``"i"``, plus a pad token (id ``vocab_size``) that no sequence holds.

    Pad gets its own id so that no data token is the embedding's padding row (zero, never trained).
    """
    vocab = {str(i): i for i in range(vocab_size)} | {PAD: vocab_size}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, unk_token=PAD)


def power_law(space: int, power_a: float) -> np.ndarray:
    """Zoology's gap distribution: p(g) ∝ a·g^(a-1) for g = 1..space (normalised)."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


def sequence(rng: np.random.Generator, vocab_size: int, seq_len: int, pairs: int, gaps_p: np.ndarray,
             random_non_queries: bool) -> tuple[list[int], list[int], list[int]]:  # fmt: skip
    """One example: ``(input_ids, labels, distance)``."""
    half = vocab_size // 2
    keys = rng.choice(np.arange(1, half), size=pairs, replace=False)
    values = rng.choice(np.arange(half, vocab_size), size=pairs, replace=False)
    context = 2 * pairs
    if random_non_queries:
        ids = rng.integers(0, vocab_size, size=seq_len)
    else:
        ids = np.zeros(seq_len, dtype=np.int64)
    ids[0:context:2], ids[1:context:2] = keys, values
    queries = context + 2 * rng.choice(len(gaps_p), size=pairs, replace=False, p=gaps_p)
    ids[queries] = keys
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    distance = np.full(seq_len, NO_DISTANCE, dtype=np.int64)
    labels[queries + 1] = values
    distance[queries + 1] = queries - 2 * np.arange(pairs)  # key i stands at position 2i
    return ids.tolist(), labels.tolist(), distance.tolist()


def check_options(vocab_size: int, seq_len: int, num_kv_pairs: int, power_a: float) -> None:
    if num_kv_pairs < 1 or seq_len % 2 or num_kv_pairs * 4 > seq_len:
        raise ValueError(
            f"mqar: seq_len={seq_len} must be even and hold the pairs and as many query slots "
            f"(seq_len >= 4 * num_kv_pairs, num_kv_pairs={num_kv_pairs} >= 1)."
        )
    if vocab_size // 2 - 1 < num_kv_pairs or vocab_size <= seq_len:
        raise ValueError(
            f"mqar: vocab_size={vocab_size} is too small; keys and values each need num_kv_pairs={num_kv_pairs} "
            f"distinct tokens and Zoology keeps vocab_size > seq_len={seq_len}."
        )
    if not 0 < power_a <= 1:
        raise ValueError(f"mqar: power_a={power_a} must lie in (0, 1] (1: uniform gaps; Zoology uses 0.01).")


def build(
    vocab_size: int = 8192,
    seq_len: int = 64,
    num_kv_pairs: int = 4,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    num_train_examples: int = 20_000,
    num_validation_examples: int = 500,
    num_test_examples: int = 1_000,
    seed: int = 0,
) -> datasets.DatasetDict:
    """DatasetDict (train / validation / test) of ``input_ids``, ``labels``, ``distance``."""
    check_options(vocab_size, seq_len, num_kv_pairs, power_a)
    gaps_p = power_law((seq_len - 2 * num_kv_pairs) // 2, power_a)
    sizes = {"train": num_train_examples, "validation": num_validation_examples, "test": num_test_examples}
    streams = np.random.SeedSequence(seed).spawn(len(SPLIT_STREAMS))
    seen: set[tuple[int, ...]] = set()
    splits = {}
    for split, index in SPLIT_STREAMS.items():
        rng = np.random.default_rng(streams[index])
        rows: dict[str, list] = {"input_ids": [], "labels": [], "distance": []}
        for _ in range(sizes[split]):
            ids, labels, distance = sequence(rng, vocab_size, seq_len, num_kv_pairs, gaps_p, random_non_queries)
            if split != "train" and tuple(ids) in seen:
                continue  # a sequence also drawn for training would measure memorisation, not recall
            rows["input_ids"].append(ids)
            rows["labels"].append(labels)
            rows["distance"].append(distance)
        if split == "train":
            seen = {tuple(ids) for ids in rows["input_ids"]}
        splits[split] = datasets.Dataset.from_dict(rows)
    return datasets.DatasetDict(splits)
