"""The passkey task of the KV-cache benchmark (:mod:`zoo.bench.passkey`) as a ``zoo eval`` task: a 5-digit key in
repeated filler at a depth, asked for at the end."""

from __future__ import annotations

import random

from zoo.bench.passkey import HEADER, NEEDLE, NEW_TOKENS, QUESTION, build_prompt
from zoo.eval.tasks.haystack import MIN_HAYSTACK, Prompt, encode, too_short_for_haystack
from zoo.eval.tasks.registry import EvalTask, register


def passkey(tokenizer, length: int, rng: random.Random, depth: float) -> Prompt:
    """``zoo.bench.passkey.build_prompt`` with a key drawn from ``rng``; the answer is the key."""
    key = rng.randrange(10_000, 100_000)
    question = encode(tokenizer, QUESTION)
    fixed = len(encode(tokenizer, HEADER)) + len(encode(tokenizer, NEEDLE.format(key=key))) + len(question)
    if length - fixed < MIN_HAYSTACK:
        raise too_short_for_haystack("passkey", length, fixed, "the header, needle and question")
    return Prompt(ids=build_prompt(tokenizer, length, depth, key), answers=[str(key)], question_tokens=len(question),
                  depth=depth, meta={"haystack": "noise", "key": key})


register(EvalTask("passkey", passkey, depth=True, new_tokens=NEW_TOKENS))  # the benchmark's answer budget
