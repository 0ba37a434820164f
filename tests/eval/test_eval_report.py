"""The eval report finds rows by their contestant's fields (:mod:`zoo.eval.rows`), never by their names."""

from __future__ import annotations

import pytest

from zoo.eval.config import expand_contestants
from zoo.eval.report import headline, policy_robustness, reference_name, zoo_against_kvpress
from zoo.eval.rows import row_fields, with_fields
from zoo.eval.scoring import paired_share, summarize


def _answer(contestant: dict, scores: list[float], task: str = "niah_single", length: int = 1024) -> dict:
    kept = contestant.get("budget", 1.0)
    return {"contestant": contestant["name"], "family": contestant["family"], "kept": kept, "task": task,
            "length": length, "indices": list(range(len(scores))), "outputs": ["x"] * len(scores), "scores": scores,
            **summarize(scores), "cache_bytes": int(1000 * kept), **row_fields(contestant)}


def _results(answers: list[dict]) -> dict:
    return {"answers": answers, "speed": [], "perplexity": [], "errors": [], "speed_errors": []}


def test_a_renamed_full_contestant_still_gives_the_of_full_column():
    contestants = expand_contestants([{"family": "full", "name": "baseline"},
                                      {"family": "budget", "policies": ["tova", "snapkv"], "budgets": [0.5]},
                                      {"family": "quantized", "nbits": 2, "name": "two bits"}])
    answers = [_answer(c, s) for c, s in zip(contestants, [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]],
                                             strict=True)]
    assert reference_name(answers) == "baseline"
    table, records = headline(_results(answers))
    shares = {r["contestant"]: r["share_of_full"] for r in records}
    assert shares == {"baseline": 1.0, "budget tova 50%": 0.5, "budget snapkv 50%": 0.25, "two bits": 0.75}
    assert "of full" in table[0] and "| 50% |" in table[3] and "| 2-bit |" in table[5]
    assert {r["contestant"]: r["policy"] for r in records}["budget snapkv 50%"] == "snapkv"


def test_renamed_budget_contestants_are_grouped_by_their_policy_field():
    tova, snapkv = expand_contestants([{"family": "budget", "policy": "tova", "budgets": [0.25], "name": "mine"},
                                       {"family": "budget", "policy": "snapkv", "budgets": [0.25], "name": "theirs"}])
    answers = [_answer(tova, [1, 1]), _answer(snapkv, [0, 0])]
    lines = policy_robustness(answers, [1024])
    assert lines[2].startswith("| tova |") and lines[3].startswith("| snapkv |")


def test_the_peers_decoding_press_is_left_out_by_its_field():
    peer = [{"contestant": f"peer {i}", "family": "kvpress", "press": press, "budget": 0.25, "kept": 0.25,
             "task": "niah_single", "length": 1024, "scores": scores, **summarize(scores)}
            for i, (press, scores) in enumerate([("DecodingPress (KNorm)", [1, 1]), ("SnapKV", [0, 1])])]
    zoo = expand_contestants([{"family": "budget", "policy": "tova", "budgets": [0.25]}])[0]
    answers = [_answer(zoo, [1, 0])] + [with_fields(r) for r in peer]
    (line,) = zoo_against_kvpress(answers, [1024])
    assert "`peer 1`" in line and "peer 0" not in line


def test_old_records_get_their_fields_from_the_default_names():
    assert with_fields({"contestant": "budget tova 50%", "family": "budget", "kept": 0.5})["policy"] == "tova"
    assert with_fields({"contestant": "QuantizedCache 4-bit", "family": "quantized"})["nbits"] == 4
    window = with_fields({"contestant": "window + 4 sinks 512 keys", "family": "window", "kept": 0.125})
    assert window["tokens"] == 512 and window["budget"] is None and window["source"] == "zoo"
    old_peer = with_fields({"contestant": "kvpress DecodingPress (KNorm) 10%", "family": "kvpress",
                            "press": "DecodingPress (KNorm)", "budget": 0.1})
    assert old_peer["source"] == "kvpress" and old_peer["decoding"] and old_peer["policy"] == "DecodingPress (KNorm)"
    full = with_fields({"contestant": "full cache", "family": "full", "kept": 1.0})
    assert full["source"] == "zoo" and full["policy"] is None


def test_paired_share_interval_is_a_point_for_equal_scores_and_wide_for_few_samples():
    same = paired_share([[1, 0, 1, 1], [0.5, 1]], [[1, 0, 1, 1], [0.5, 1]])
    assert same["share"] == same["low"] == same["high"] == 1.0
    half = paired_share([[1, 0, 1, 0, 1, 0]], [[1, 1, 1, 1, 1, 1]])
    assert half["share"] == 0.5 and half["low"] < 0.3 and half["high"] > 0.7  # six samples say little
    many = paired_share([[1, 0] * 200], [[1, 1] * 200])
    assert many["share"] == 0.5 and many["high"] - many["low"] < 0.15
    assert paired_share([[1, 1]], [[0, 0]]) is None  # no share of nothing
    with pytest.raises(ValueError, match="same samples"):
        paired_share([[1, 1]], [[1, 1, 1]])


def test_the_of_full_column_carries_the_paired_interval():
    full, budget = expand_contestants([{"family": "full"}, {"family": "budget", "policy": "tova", "budgets": [0.5]}])
    answers = [_answer(full, [1, 1, 1, 1]), _answer(budget, [1, 1, 0, 0])]
    table, records = headline(_results(answers))
    paired = {r["contestant"]: r["share_of_full_paired"] for r in records}
    assert paired[full["name"]]["low"] == 1.0 and paired[budget["name"]]["share"] == 0.5
    assert "of full [paired 95%]" in table[0] and "| 50% [" in table[3]
