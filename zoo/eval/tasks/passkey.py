"""The passkey task of the KV-cache benchmark (:mod:`zoo.bench.passkey`) as a ``zoo eval`` task: a 5-digit key in
repeated filler at a depth, asked for at the end.

The benchmark's header, filler, needle and question, put together as the other tasks are (not by
``zoo.bench.passkey.build_prompt``, whose prompts the benchmark's records hold): the filler tokenized as one text
(:func:`~.haystack.noise`), the needle at a sentence boundary near its depth, and the question on a line of its own,
so the ids are the ones the tokenizer gives the decoded prompt.
"""

from __future__ import annotations

import random

from zoo.bench.passkey import HEADER, NEEDLE, QUESTION
from zoo.eval.tasks.haystack import MIN_HAYSTACK, Prompt, encode, insert_needles, noise, too_short_for_haystack
from zoo.eval.tasks.registry import EvalTask, register


def passkey(tokenizer, length: int, rng: random.Random, depth: float) -> Prompt:
    """The header, the filler with the needle (a key drawn from ``rng``) at ``depth`` of it, and on a line of its own
    the question; the answer is the key."""
    key = rng.randrange(10_000, 100_000)
    head = encode(tokenizer, HEADER)
    needle = encode(tokenizer, " " + NEEDLE.format(key=key).strip())
    question = encode(tokenizer, "\n" + QUESTION)
    fixed = len(head) + len(needle) + len(question)
    if length - fixed < MIN_HAYSTACK:
        raise too_short_for_haystack("passkey", length, fixed, "the header, needle and question")
    body, (offset,) = insert_needles(tokenizer, noise(tokenizer, length - fixed), [(depth, needle)])
    return Prompt(ids=head + body + question, answers=[str(key)], question_tokens=len(question), depth=depth,
                  meta={"haystack": "noise", "key": key, "needle_offset": len(head) + offset})


register(EvalTask("passkey", passkey, depth=True))
