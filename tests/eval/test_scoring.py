"""zoo.eval.scoring: RULER's recall (whole words, digit runs, case, partial credit) and Wilson intervals."""

from __future__ import annotations

import math

import pytest

from zoo.eval.scoring import found, intervals_overlap, score, summarize, wilson


def test_a_word_answer_must_be_a_whole_word():
    assert score(["cat"], "The answer is cat.") == 1.0
    assert score(["cat"], "category") == 0.0
    assert score(["cat"], "bobcat") == 0.0
    assert score(["river"], "1. apple 2. river 3. stone") == 1.0
    assert score(["ABCDE"], "VAR ABCDE, VAR FGHIJ") == 1.0
    assert score(["ABCDE"], "VAR ABCDEF") == 0.0


def test_a_number_must_not_sit_inside_a_longer_run_of_digits():
    assert score(["1234567"], " 1234567.") == 1.0
    assert score(["1234567"], "The number is 1234567, yes") == 1.0
    assert score(["1234567"], "91234567") == 0.0
    assert score(["1234567"], "12345678") == 0.0
    assert score(["1234567"], "123456") == 0.0
    assert score(["1234567"], "key-1234567x") == 1.0  # letters around a number do not extend its run


def test_uuids_match_as_substrings_and_case_does_not_matter():
    uuid = "e5e1edbb-6d7e-4b66-88f1-bb4d0f0c850c"
    assert score([uuid], f"is: {uuid}.") == 1.0
    assert score([uuid], f"is: {uuid.upper()}") == 1.0
    assert score([uuid], uuid[:-1]) == 0.0
    assert score(["Apple"], "APPLE and pear") == 1.0
    assert score(["  apple \n"], "an apple") == 1.0, "whitespace around an answer is stripped"
    assert not found("", "anything")


def test_partial_credit_is_the_share_of_answers_found():
    answers = ["1111111", "2222222", "3333333", "4444444"]
    assert score(answers, "1111111, 3333333") == 0.5
    assert score(answers, "4444444 2222222 1111111 3333333") == 1.0
    assert score(answers, "none of them") == 0.0
    assert score(["apple", "river", "stone"], "apple, stone") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no expected answers"):
        score([], "x")


def test_wilson_matches_known_values():
    low, high = wilson(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)
    low, high = wilson(0, 5)
    assert low == 0.0 and high == pytest.approx(0.4345, abs=1e-4)
    low, high = wilson(5, 5)
    assert high == 1.0 and low == pytest.approx(0.5655, abs=1e-4)
    low, high = wilson(81, 263)  # Wilson's interval as tabulated for 81/263 at 95%
    assert low == pytest.approx(0.2553, abs=1e-3) and high == pytest.approx(0.3662, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson(6, 5)


def test_wilson_takes_fractional_successes_and_narrows_with_n():
    low, high = wilson(2.5, 10)
    assert wilson(2, 10)[0] < low < wilson(3, 10)[0] and wilson(2, 10)[1] < high < wilson(3, 10)[1]
    assert wilson(50, 100)[1] - wilson(50, 100)[0] < wilson(5, 10)[1] - wilson(5, 10)[0]
    z = 1.96
    p, n = 0.25, 10
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert low == pytest.approx(center - half) and high == pytest.approx(center + half)


def test_summarize_and_overlap():
    summary = summarize([1.0, 0.0, 0.5, 0.5])
    assert summary["score"] == 0.5 and summary["n"] == 4
    assert (summary["low"], summary["high"]) == pytest.approx(wilson(2.0, 4))
    assert summarize([]) == {"score": 0.0, "low": 0.0, "high": 1.0, "n": 0}
    assert summarize([1 / 3] * 3)["high"] <= 1.0
    good, bad = summarize([1.0] * 20), summarize([0.0] * 20)
    assert not intervals_overlap(good, bad) and not intervals_overlap(bad, good)
    assert intervals_overlap(summarize([1.0] * 3), summarize([0.0] * 3))
    assert intervals_overlap(good, good)
