"""The passkey task of the KV-cache benchmark (:mod:`zoo.bench.kv`): a 5-digit key hidden at a depth of repeated
filler, asked for at the end; it is found when the greedy continuation (``NEW_TOKENS`` tokens) contains the key.
Prompts of one context length have the same token count, so they run as one batch. Prompts are kept in
``prompts.json`` (token ids included), which the kvpress peer (``scripts/kvpress_peer.py``) reads too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from zoo.data.pretrained import smollm2

HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you "
          "about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
NEW_TOKENS = 8


def build_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Exactly ``length`` token ids: header, filler with the needle at ``depth`` of it, the question."""
    return prompt_parts(tokenizer, length, depth, key)[0]


def prompt_parts(tokenizer, length: int, depth: float, key: int) -> tuple[list[int], tuple[int, int]]:
    """:func:`build_prompt`'s ids and the needle's token span ``[start, end)`` in them."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    head, needle, question, filler = ids(HEADER), ids(NEEDLE.format(key=key)), ids(QUESTION), ids(FILLER)
    room = length - len(head) - len(needle) - len(question)
    body = (filler * (room // len(filler) + 1))[:room]
    cut = int(depth * room)
    start = len(head) + cut
    return head + body[:cut] + needle + body[cut:] + question, (start, start + len(needle))


def write_prompts(out: Path, contexts: list[int], depths: list[float], keys: int, seed: int = 0) -> Path:
    """Write ``keys`` prompts per context and depth to ``prompts.json``, replacing that file's prompts of these
    contexts only (the others, and the rows measured on them, stay valid). Keys drawn from ``seed + context``."""
    _, tokenizer = smollm2()
    path = out / "prompts.json"
    rows = [row for row in json.loads(path.read_text()) if row["context"] not in contexts] if path.exists() else []
    for context in contexts:
        rng = random.Random(seed + context)
        rows += [{"context": context, "depth": d, "key": rng.randrange(10000, 100000)} for d in depths
                 for _ in range(keys)]
    for row in rows:
        row.setdefault("ids", build_prompt(tokenizer, row["context"], row["depth"], row["key"]))
    path.write_text(json.dumps(rows))
    return path


def load_prompts(out: Path, context: int, keys_per_depth: int = 0) -> list[dict]:
    """The prompts of ``context`` tokens in ``out/prompts.json``; ``keys_per_depth``: only the first N per depth."""
    prompts = [row for row in json.loads((out / "prompts.json").read_text()) if row["context"] == context]
    if keys_per_depth:
        prompts = [row for depth in sorted({r["depth"] for r in prompts})
                   for row in [r for r in prompts if r["depth"] == depth][:keys_per_depth]]
    return prompts


def found(prompts: list[dict], answers: list[str]) -> list[bool]:
    """Per prompt: whether its key is in the answer."""
    return [str(row["key"]) in answer for row, answer in zip(prompts, answers, strict=True)]
