"""Variable tracking: chains of assignments (``VAR ABCDE = 12345.``, then ``VAR FGHIJ = VAR ABCDE.`` ...) spread in
order over a haystack; the question asks for every variable that ends up holding the first chain's value. The other
chains hold other values (distractors).
"""

from __future__ import annotations

import random
import string

from zoo.eval.tasks.haystack import (
    HAYSTACKS,
    MIN_HAYSTACK,
    Prompt,
    check_choice,
    check_count,
    encode,
    insert_needles,
    too_short_for_haystack,
)
from zoo.eval.tasks.haystack import haystack as make_haystack
from zoo.eval.tasks.registry import EvalTask, numbered, register

HEADER = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
FIRST = "VAR {name} = {value}."
HOP = "VAR {name} = VAR {previous}."
QUESTION = ("\nFind all variables that are assigned the value {value} in the text above. Answer: According "
            "to the chain(s) of variable assignment in the text above, {count} variables are assigned the value "
            "{value}, they are:")


def _names(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct names of 5 uppercase letters."""
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    return names


def _values(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct 5-digit numbers."""
    return [str(v) for v in rng.sample(range(10_000, 100_000), count)]


def variable_tracking(tokenizer, length: int, rng: random.Random, depth: float | None = None, *,
                      haystack: str = "noise", chains: int = 1, hops: int = 4) -> Prompt:
    """``chains`` chains of ``hops`` assignments after the first; the answer is the first chain's ``hops + 1`` names.

    The statements sit at sorted random depths, each chain in its order, the chains interleaved at random;
    ``depth`` is not used.
    """
    task = "variable_tracking"
    check_choice(task, "haystack", haystack, HAYSTACKS)
    check_count(task, "chains", chains)
    check_count(task, "hops", hops)
    names = _names(rng, chains * (hops + 1))
    values = _values(rng, chains)
    chain_names = [names[c * (hops + 1) : (c + 1) * (hops + 1)] for c in range(chains)]
    statements = [[FIRST.format(name=group[0], value=values[c])]
                  + [HOP.format(name=group[j], previous=group[j - 1]) for j in range(1, hops + 1)]
                  for c, group in enumerate(chain_names)]
    head = encode(tokenizer, HEADER)
    asked = encode(tokenizer, QUESTION.format(value=values[0], count=hops + 1))
    pieces = [[encode(tokenizer, " " + text) for text in chain] for chain in statements]
    fixed = len(head) + len(asked) + sum(len(ids) for chain in pieces for ids in chain)
    room = length - fixed
    if room < MIN_HAYSTACK:
        raise too_short_for_haystack(task, length, fixed, "the header, assignments and question")
    hay, where = make_haystack(tokenizer, haystack, room, rng)
    turns = [c for c in range(chains) for _ in range(hops + 1)]
    rng.shuffle(turns)
    depths = sorted(rng.random() for _ in turns)
    needles, cursor = [], [0] * chains
    for depth_here, c in zip(depths, turns, strict=True):
        needles.append((depth_here, pieces[c][cursor[c]]))
        cursor[c] += 1
    body, offsets = insert_needles(tokenizer, hay, needles, keep_order=True)
    return Prompt(ids=head + body + asked, answers=list(chain_names[0]), question_tokens=len(asked), depth=None,
                  meta={**where, "chains": [{"value": v, "names": n} for v, n in zip(values, chain_names, strict=True)],
                        "hops": hops, "statement_depths": depths,
                        "statement_offsets": [len(head) + offset for offset in offsets]})


def _forms(names: list[str]) -> list[str]:
    """The names as the assignments write them (``VAR ABCDE``): a comma list and a numbered one."""
    named = [f"VAR {name}" for name in names]
    return [", ".join(named), numbered(named)]


register(EvalTask("variable_tracking", variable_tracking, answer_forms=_forms))
