"""The registry of ``zoo eval`` tasks: each task module describes its tasks as :class:`EvalTask` s and registers them
(:func:`register`) when it is imported, so adding a task is one module (and its import in
:mod:`zoo.eval.tasks`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from zoo.eval.tasks.haystack import Prompt, encode


@dataclass(frozen=True)
class EvalTask:
    """One ``zoo eval`` task.

    Args:
        name: the task's name in configs.
        build: ``build(tokenizer, length, rng, depth, **options) -> Prompt``; its keyword-only parameters are the
            task's options, with their defaults.
        depth: whether its samples put a needle at a depth (else a sample's ``depth`` is None).
        answer_forms: other ways models tend to write the answers, beside the comma list and (for several answers)
            the numbered list (:func:`list_forms`); the answer budget holds the longest form.
        new_tokens: a fixed answer budget instead of the one measured from the answers.
    """

    name: str
    build: Callable[..., Prompt]
    depth: bool = False
    answer_forms: Callable[[list[str]], list[str]] | None = None
    new_tokens: int | None = None

    def forms(self, answers: list[str]) -> list[str]:
        """Every way of writing ``answers`` that the answer budget holds: :func:`list_forms` and the task's own."""
        return [*list_forms(answers), *(self.answer_forms(answers) if self.answer_forms else [])]

    def need(self, tokenizer, answers: list[str]) -> int:
        """The tokens of the longest of :meth:`forms` (after a space, as it follows the answer prefix)."""
        return max(len(encode(tokenizer, " " + form)) for form in self.forms(answers))

    def answer_tokens(self, tokenizer, answers: list[str]) -> int:
        """Tokens enough for a greedy answer naming every expected string, with room to spare: the longest form of
        the answers (:meth:`need`) plus a fifth, at least 4 tokens; or ``new_tokens`` when set."""
        if self.new_tokens is not None:
            return self.new_tokens
        need = self.need(tokenizer, answers)
        return need + max(4, need // 5)


def numbered(items: list[str]) -> str:
    """``1. a`` / ``2. b`` ..., a line each."""
    return "\n".join(f"{number}. {item}" for number, item in enumerate(items, 1))


def list_forms(answers: list[str]) -> list[str]:
    """The ways of writing the answers that every task's budget holds: the comma list, and for several answers the
    numbered list (:func:`numbered`, the longer: a three-word answer of ``frequent_words`` is 8 SmolLM2 tokens as a
    comma list, 15 numbered)."""
    return [", ".join(answers), *([numbered(answers)] if len(answers) > 1 else [])]


REGISTRY: dict[str, EvalTask] = {}


def register(*tasks: EvalTask) -> None:
    """Make ``tasks`` known to ``zoo eval`` by their names (a name taken by another builder is an error)."""
    for task in tasks:
        held = REGISTRY.get(task.name)
        if held is not None and _where(held.build) != _where(task.build):
            raise ValueError(f"zoo eval: the task {task.name!r} is registered already (by {_where(held.build)}); "
                             "give the new task another name.")
        REGISTRY[task.name] = task


def _where(build: Callable) -> str:
    return f"{build.__module__}.{build.__qualname__}"
