"""Language-modelling data: a byte-level BPE tokenizer trained on the training split, documents cut into chunks.

A chunk never crosses a document boundary (a book, a Brown sample), so the position of a token in its chunk is
the amount of its own document the model has read: what the loss-by-position metric (:mod:`zoo.training.lm`) measures.
Chunks are ``max_length`` tokens, packed back to back (a batch needs no padding); a document's shorter tail is
dropped unless it has at least ``min_chunk_length`` tokens (then it is padded in its batch, labels masked).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from zoo.data.cache import cached_folder

TOKENIZER_VERSION = 1  # bump when the tokenizer recipe below changes, so cached tokenizers are retrained
END_OF_TEXT, PAD = "<|endoftext|>", "<|pad|>"
MIN_VOCAB_SIZE = 512  # 256 byte symbols + specials + a few merges


def bpe_tokenizer(train_texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``train_texts`` (the training split only: no eval text leaks into the
    vocabulary), cached under the zoo cache by a hash of the texts and the vocabulary size."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"tokenizer_vocab_size={vocab_size} is too small for byte-level BPE; use >= {MIN_VOCAB_SIZE}.")
    digest = hashlib.sha256()
    for text in train_texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    key = f"bpe-v{TOKENIZER_VERSION}-{vocab_size}-{digest.hexdigest()[:16]}"
    folder = cached_folder("tokenizers", key, lambda path: train_bpe(train_texts, vocab_size).save_pretrained(path))
    return PreTrainedTokenizerFast.from_pretrained(folder)


def train_bpe(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, pad_token=PAD
    )


def chunk_documents(
    dataset: datasets.DatasetDict, tokenizer, max_length: int, min_chunk_length: int | None = None
) -> datasets.DatasetDict:
    """Tokenize every document and cut it into chunks: ``input_ids``, ``document``, ``start`` (token offset)."""
    shortest = max_length if min_chunk_length is None else min_chunk_length
    if not 2 <= shortest <= max_length:
        raise ValueError(f"min_chunk_length={min_chunk_length} must lie between 2 and max_length={max_length}.")

    def encode(batch):
        return {"input_ids": tokenizer(batch["text"], verbose=False)["input_ids"], "document": batch["document"]}

    def chunk(batch):
        chunks: dict[str, list] = {"input_ids": [], "document": [], "start": []}
        for ids, document in zip(batch["input_ids"], batch["document"], strict=True):
            for start in range(0, len(ids) - shortest + 1, max_length):
                chunks["input_ids"].append(ids[start : start + max_length])
                chunks["document"].append(document)
                chunks["start"].append(start)
        return chunks

    # Two passes, so the tokenized documents (the slow part, cached by datasets) serve every max_length.
    columns = dataset["train"].column_names
    encoded = dataset.map(encode, batched=True, batch_size=16, remove_columns=columns, desc="tokenizing documents")
    chunked = encoded.map(chunk, batched=True, remove_columns=["input_ids", "document"], desc="chunking")
    for split, rows in chunked.items():
        if len(rows) == 0:
            raise ValueError(
                f"no document of the {split} split has {shortest} tokens, so it yields no chunk; lower max_length "
                "or set min_chunk_length (a document's shorter tail is dropped otherwise)."
            )
    return chunked


def spread_windows(books: Sequence[Sequence[int]], length: int, count: int, what: str = "a document",
                   fix: str = "lower the count or the length") -> list[list[int]]:
    """``count`` windows of ``length`` token ids taken in turn from each of ``books`` at evenly spaced offsets,
    never overlapping (held-out text for perplexity, sequences for a retrofit)."""
    picked: list[list[int]] = []
    per_book = math.ceil(count / len(books))
    for ids in books:
        slots = len(ids) // length
        if slots < per_book:
            raise ValueError(f"{what} has {len(ids)} tokens, too few for {per_book} windows of {length}; {fix}.")
        step = slots // per_book
        picked += [list(ids[i * step * length : (i * step + 1) * length]) for i in range(per_book)]
    order = [picked[b * per_book + i] for i in range(per_book) for b in range(len(books))]
    return order[:count]
