"""Scoring ``zoo eval`` answers (recall of the expected strings in the greedy output), the Wilson score interval
of a task's mean score, and a contestant's share of the reference's score with a paired bootstrap interval.

Two scorings (a sample's ``meta["scoring"]`` names its own; the report says which each row used):

- ``ruler``: RULER's ``string_match_all`` exactly (NVIDIA RULER, and lm-evaluation-harness's port,
  ``lm_eval/tasks/ruler/common_utils.py``): the output stripped, control characters turned into line breaks, then
  the share of answers that occur in it as case-insensitive substrings, so "12345678" counts for 1234567. RULER's
  own tasks (``zoo.eval.ruler``) are scored so.
- ``strict``: the zoo's own tasks' default: the same recall, but a number must not sit inside a longer run of digits
  and an alphabetic answer must be a whole word ("porch" is not in "porches").
"""

from __future__ import annotations

import math
import re

import torch


def _pattern(answer: str) -> re.Pattern[str]:
    """How ``answer`` is looked for: a number not inside a longer run of digits, an alphabetic answer as a whole
    word, anything else (a UUID, a key) as a plain substring; all case-insensitive."""
    escaped = re.escape(answer)
    if answer.isdigit():
        return re.compile(rf"(?<!\d){escaped}(?!\d)")
    if answer.isalpha():
        return re.compile(rf"\b{escaped}\b", re.IGNORECASE)
    return re.compile(escaped, re.IGNORECASE)


def found(answer: str, output: str) -> bool:
    """Whether the expected string ``answer`` occurs in ``output`` (see :func:`score`)."""
    answer = answer.strip()
    return bool(answer) and _pattern(answer).search(output) is not None


SCORINGS = ("strict", "ruler")
_CONTROL = re.compile(r"[\x00-\x1f]")


def ruler_found(answer: str, output: str) -> bool:
    """RULER's test: ``answer`` occurs in ``output`` (stripped, control characters as line breaks), ignoring case."""
    return answer.lower() in _CONTROL.sub("\n", output.strip()).strip().lower()


def score(answers: list[str], output: str, scoring: str = "strict") -> float:
    """The share of ``answers`` that occur in ``output``, by ``scoring`` (``strict`` or ``ruler``, see above).

    ``strict``: case-insensitive, surrounding whitespace stripped; an alphabetic answer must occur as a whole word
    (``cat`` is not in ``category``), a number not inside a longer run of digits (``1234567`` is not in
    ``912345678``), other answers (UUIDs) as plain substrings. ``ruler``: any case-insensitive substring
    (:func:`ruler_found`).

    Args:
        answers: the expected strings (at least one).
        output: the model's greedy continuation, decoded.
        scoring: ``strict`` (default) or ``ruler``.

    Returns:
        The share found, 0..1 (2 of 4 answers: 0.5).
    """
    if not answers:
        raise ValueError("score: no expected answers to look for")
    if scoring not in SCORINGS:
        raise ValueError(f"score: unknown scoring {scoring!r}; use one of {', '.join(SCORINGS)}.")
    test = ruler_found if scoring == "ruler" else found
    return sum(test(answer, output) for answer in answers) / len(answers)


def sample_score(sample, output: str) -> float:
    """``output`` scored for a :class:`~zoo.eval.tasks.Sample` by its scoring (``meta["scoring"]``, default
    ``strict``)."""
    return score(sample.answers, output, sample.meta.get("scoring", "strict"))


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion: ``successes`` of ``n`` (fractional successes allowed).

    Returns:
        ``(low, high)``; ``(0.0, 1.0)`` when ``n`` is 0.
    """
    if n == 0:
        return 0.0, 1.0
    if n < 0 or not -1e-9 <= successes <= n + 1e-9:  # a sum of fractional scores may be off by a rounding
        raise ValueError(f"wilson: successes={successes} of n={n}; need 0 <= successes <= n")
    successes = min(max(successes, 0.0), n)
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # the interval always holds the observed share (rounding would put it a hair outside at 0 and 1)
    return min(p, max(0.0, center - half)), max(p, min(1.0, center + half))


def summarize(scores: list[float]) -> dict:
    """The mean score of a task's samples and its 95% Wilson interval.

    Per-sample partial scores (a multi-answer task's 0.5) are treated as a proportion over the samples: the interval
    is Wilson's for ``sum(scores)`` successes of ``len(scores)`` trials, an approximation (exact for 0/1 scores).

    Returns:
        ``{"score": mean, "low": ..., "high": ..., "n": len(scores)}`` (score 0.0 and interval 0..1 when empty).
    """
    n = len(scores)
    low, high = wilson(sum(scores), n)
    return {"score": sum(scores) / n if n else 0.0, "low": low, "high": high, "n": n}


def intervals_overlap(a: dict, b: dict) -> bool:
    """Whether two :func:`summarize` results' intervals overlap (touching counts as overlapping)."""
    return a["low"] <= b["high"] and b["low"] <= a["high"]


def paired_share(scores: list[list[float]], reference: list[list[float]], resamples: int = 2000,
                 seed: int = 0) -> dict | None:
    """A contestant's score as a share of the reference's on the same samples, with a paired 95% bootstrap interval.

    ``scores`` and ``reference`` hold one list per task x length cell, sample by sample in the same order (the same
    prompts). Each resample draws the samples of every cell with replacement, the same draw for both (paired), and
    takes the ratio of the two means over all cells; the interval is its 2.5th and 97.5th percentiles. None when the
    reference scores 0 (no share to state).

    Returns:
        ``{"share": ..., "low": ..., "high": ..., "resamples": ...}``.
    """
    if [len(cell) for cell in scores] != [len(cell) for cell in reference]:
        raise ValueError("paired_share: the contestant and the reference must have the same samples in each cell")
    mine, theirs = (torch.tensor([s for cell in x for s in cell], dtype=torch.float64) for x in (scores, reference))
    if float(theirs.sum()) == 0:
        return None
    generator = torch.Generator().manual_seed(seed)
    draws, start = [], 0
    for cell in reference:  # stratified: every cell keeps its sample count
        draws.append(start + torch.randint(len(cell), (resamples, len(cell)), generator=generator))
        start += len(cell)
    index = torch.cat(draws, dim=1)
    ratio = mine[index].sum(1) / theirs[index].sum(1).clamp_min(1e-12)
    low, high = torch.quantile(ratio, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"share": float(mine.sum() / theirs.sum()), "low": low, "high": high, "resamples": resamples}
