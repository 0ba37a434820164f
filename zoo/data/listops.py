"""LRA ListOps, generated locally: nested MIN / MAX / MED / SM (sum mod 10) over digits, 10 classes.

Follows the Long Range Arena generator (Tay et al. 2021): a node is a digit with probability
``leaf_probability`` (0.75), otherwise an operator over 2..``max_args`` sub-trees; depth at most
``max_depth``; only sequences with ``min_length < length < max_length`` tokens are kept (LRA: 500, 2000);
duplicates are dropped. Unlike the original pipeline, the closing bracket ``]`` stays a token: without it
``[MAX 1 [MIN 2 3 ] 4 ]`` and ``[MAX 1 [MIN 2 3 4 ] ]`` read the same.

Example text: ``[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]`` (label 5).
"""

from __future__ import annotations

import random
import statistics

import datasets
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
DIGITS = tuple(str(d) for d in range(10))
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
LABEL_NAMES = list(DIGITS)
SOURCE = "generated locally (LRA ListOps rules, closing brackets kept)"

Tree = int | tuple  # a digit, or (operator, [children])


def generate_tree(rng: random.Random, depth: int, max_depth: int, max_args: int, leaf_probability: float) -> Tree:
    if depth >= max_depth or rng.random() < leaf_probability:
        return rng.randrange(10)
    operator = rng.choice(OPERATORS)
    arity = rng.randint(2, max_args)
    children = [generate_tree(rng, depth + 1, max_depth, max_args, leaf_probability) for _ in range(arity)]
    return (operator, children)


def tree_length(tree: Tree) -> int:
    """Number of tokens: a digit is one, an operator node adds its operator and its closing bracket."""
    if isinstance(tree, int):
        return 1
    return 2 + sum(tree_length(child) for child in tree[1])


def to_tokens(tree: Tree) -> list[str]:
    if isinstance(tree, int):
        return [str(tree)]
    operator, children = tree
    tokens = [operator]
    for child in children:
        tokens.extend(to_tokens(child))
    tokens.append(CLOSE)
    return tokens


def apply_operator(operator: str, values: list[int]) -> int:
    if operator == "[MIN":
        return min(values)
    if operator == "[MAX":
        return max(values)
    if operator == "[MED":
        return int(statistics.median(values))  # LRA: int(np.median(...)), truncating .5 medians
    if operator == "[SM":
        return sum(values) % 10
    raise ValueError(f"unknown ListOps operator {operator!r}")


def evaluate_tree(tree: Tree) -> int:
    if isinstance(tree, int):
        return tree
    operator, children = tree
    return apply_operator(operator, [evaluate_tree(child) for child in children])


def generate_examples(
    count: int,
    min_length: int,
    max_length: int,
    max_depth: int,
    max_args: int,
    leaf_probability: float,
    rng: random.Random,
    seen: set[str],
) -> list[dict]:
    """``count`` distinct examples (not in ``seen``, which is updated) with min_length < length < max_length."""
    examples = []
    while len(examples) < count:
        tree = generate_tree(rng, 1, max_depth, max_args, leaf_probability)
        if not min_length < tree_length(tree) < max_length:
            continue
        text = " ".join(to_tokens(tree))
        if text in seen:
            continue
        seen.add(text)
        examples.append({"text": text, "label": evaluate_tree(tree)})
    return examples


def build(
    train_size: int = 96_000,
    validation_size: int = 2_000,
    test_size: int = 2_000,
    min_length: int = 500,
    max_length: int = 2_000,
    max_depth: int = 10,
    max_args: int = 10,
    leaf_probability: float = 0.75,
    seed: int = 0,
) -> datasets.DatasetDict:
    """The three splits, deterministic in ``seed``, with no sequence in two splits (LRA defaults)."""
    if min_length + 1 >= max_length:
        raise ValueError(f"listops: need min_length < length < max_length, got min {min_length}, max {max_length}.")
    if max_length <= 3:
        raise ValueError(f"listops: max_length={max_length} leaves no room for an operator; use at least 4.")
    rng, seen = random.Random(seed), set()
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=LABEL_NAMES)})
    splits = {}
    for split, size in (("train", train_size), ("validation", validation_size), ("test", test_size)):
        rows = generate_examples(size, min_length, max_length, max_depth, max_args, leaf_probability, rng, seen)
        splits[split] = datasets.Dataset.from_list(rows, features=features)
    return datasets.DatasetDict(splits)


def tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the ListOps vocabulary, ``[CLS] ... [SEP]`` around each sequence."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *DIGITS, *OPERATORS, CLOSE))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=model_max_length,
    )
