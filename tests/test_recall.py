"""Recall tasks and metrics: MQAR generation (zoo.data.mqar), accuracy by distance, notes (zoo.training.recall)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import EvalPrediction

from zoo.data import mqar, task_tokenizer
from zoo.data.labels import IGNORE_INDEX, NO_DISTANCE
from zoo.training import recall

SMALL = {"vocab_size": 64, "seq_len": 32, "num_kv_pairs": 4, "num_train_examples": 200,
         "num_validation_examples": 20, "num_test_examples": 50}  # fmt: skip


@pytest.fixture(scope="module")
def small():
    return mqar.build(**SMALL, seed=3)


def test_answers_are_recoverable_from_the_input(small):
    half = SMALL["vocab_size"] // 2
    for row in small["test"]:
        ids, labels, distance = row["input_ids"], row["labels"], row["distance"]
        pairs = dict(zip(ids[0:8:2], ids[1:8:2], strict=True))
        answers = [p for p, label in enumerate(labels) if label != IGNORE_INDEX]
        assert len(answers) == SMALL["num_kv_pairs"]
        for p in answers:
            query = ids[p - 1]
            assert 1 <= query < half and labels[p] == pairs[query] >= half
            assert ids[p - 1 - distance[p]] == query  # the key stands `distance` tokens before the query
        assert all(d == NO_DISTANCE for p, d in enumerate(distance) if p not in answers)


def test_labels_only_at_answer_positions(small):
    labels = np.asarray(small["train"]["labels"])
    assert (labels != IGNORE_INDEX).sum(axis=1).tolist() == [4] * len(labels)
    assert (labels[:, :9] == IGNORE_INDEX).all()  # never inside the key-value pairs or on the first query


def test_no_sequence_is_in_two_splits(small):
    train = {tuple(ids) for ids in small["train"]["input_ids"]}
    for split in ("validation", "test"):
        assert not train & {tuple(ids) for ids in small[split]["input_ids"]}
    # a tiny space forces collisions: they are removed from the held-out splits, never kept
    tiny = mqar.build(vocab_size=10, seq_len=8, num_kv_pairs=2, random_non_queries=False, num_train_examples=50,
                      num_validation_examples=10, num_test_examples=10)  # fmt: skip
    assert len(tiny["test"]) < 10 and not {tuple(x) for x in tiny["train"]["input_ids"]} & {
        tuple(x) for x in tiny["test"]["input_ids"]
    }


def test_same_seed_same_data_other_seed_other_data(small):
    again = mqar.build(**SMALL, seed=3)
    other = mqar.build(**SMALL, seed=4)
    assert again["train"]["input_ids"] == small["train"]["input_ids"]
    assert other["train"]["input_ids"] != small["train"]["input_ids"]


def test_gaps_follow_the_power_law():
    data = mqar.build(vocab_size=512, seq_len=256, num_kv_pairs=4, num_train_examples=400, num_validation_examples=1,
                      num_test_examples=1, seed=0)  # fmt: skip
    distance = np.asarray(data["train"]["distance"])
    distance = distance[distance != NO_DISTANCE]
    assert np.median(distance) < 64 and distance.max() > 128  # mostly near, a few far (a = 0.01)


@pytest.mark.parametrize(
    "options, message",
    [({"seq_len": 30, "num_kv_pairs": 8}, "seq_len"), ({"vocab_size": 16}, "vocab_size"), ({"power_a": 0}, "power_a")],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        mqar.build(**{**SMALL, **options})


def test_tokenizer_takes_the_task_vocabulary():
    tokenizer = task_tokenizer("mqar", SMALL)
    assert len(tokenizer) == 65 and tokenizer.pad_token_id == 64
    assert tokenizer("3 63")["input_ids"] == [3, 63]


def test_accuracy_by_distance_counts_answers_in_their_bucket(small):
    test = small["test"]
    labels, distance = np.asarray(test["labels"]), np.asarray(test["distance"])
    predictions = labels.copy()
    predictions[distance >= 8] = 0  # wrong on every answer 8 or more tokens from its key
    computer = recall.RecallAccuracy(test)
    metrics = computer(EvalPrediction(predictions=predictions, label_ids=labels))
    answers = labels != IGNORE_INDEX
    assert metrics["accuracy"] == pytest.approx(((distance < 8) & answers).sum() / answers.sum())
    for bucket in computer.by_distance:
        if bucket["answers"]:
            assert bucket["accuracy"] == (1.0 if bucket["end"] <= 8 else 0.0)
    assert sum(b["answers"] for b in computer.by_distance) == answers.sum()


def test_metrics_refuse_predictions_out_of_order(small):
    labels = np.asarray(small["test"]["labels"])
    with pytest.raises(RuntimeError, match="in order"):
        recall.RecallAccuracy(small["test"])(EvalPrediction(predictions=labels, label_ids=labels[::-1]))


def test_in_context_guess_is_one_over_each_sequences_distinct_answers(small):
    labels = np.full((2, 6), IGNORE_INDEX)
    labels[0, [1, 3, 5]] = [40, 41, 42]  # three distinct answers: a blind pick among them hits 1/3
    labels[1, [2, 4]] = [40, 40]  # one distinct answer: a pick always hits
    example = {"labels": labels.tolist(), "distance": np.where(labels >= 0, 2, -1).tolist()}
    metrics = recall.RecallAccuracy(example)(EvalPrediction(predictions=labels, label_ids=labels))
    assert metrics["guess_accuracy"] == pytest.approx((3 * (1 / 3) + 2 * 1) / 5)
    test = small["test"]  # MQAR: every key queried once, values distinct per sequence -> 1 / pairs
    test_labels = np.asarray(test["labels"])
    metrics = recall.RecallAccuracy(test)(EvalPrediction(predictions=test_labels, label_ids=test_labels))
    assert metrics["guess_accuracy"] == pytest.approx(1 / SMALL["num_kv_pairs"], abs=0.05)


def test_predicted_tokens_are_the_previous_positions_argmax():
    logits = torch.zeros(1, 3, 5)
    logits[0, 0, 4] = logits[0, 1, 2] = 1
    assert recall.predicted_tokens(logits, None).tolist() == [[IGNORE_INDEX, 4, 2]]


def _entry(name, accuracy, std, seeds, majority=0.01, answers=1000, guess=0.25, values=None):
    values = values or ([accuracy + std * d for d in (-1, 0, 1)][:seeds] if std else [accuracy] * seeds)
    return {"name": name, "eval_accuracy": accuracy, "eval_accuracy_std": std, "seeds_ok": seeds,
            "majority_accuracy": majority, "guess_accuracy": guess, "answers": answers,
            "seed_accuracies": list(enumerate(values))}  # fmt: skip


def test_report_notes_chance_single_seed_and_welch_t_against_the_best():
    best = _entry("sdpa", 0.95, 0.02, 3)
    close = recall.trust_notes(_entry("close", 0.93, 0.01, 3), best)
    assert close == ["not distinguishable from the best (sdpa): Welch's t = 1.55, df = 2.9, p = 0.221"]
    assert recall.trust_notes(_entry("far", 0.50, 0.01, 3), best)[0].startswith("below the best (sdpa): Welch's t")
    stalled = recall.trust_notes(_entry("stall", 0.9, 0.0, 3, values=[0.80, 0.95, 0.951]), best)
    assert stalled[0] == "seed 0 stalls (0.800 against 0.950–0.951 of the others)"
    assert stalled[-1].startswith("without the stalled seed not distinguishable from the best (sdpa)")
    assert recall.trust_notes(_entry("chance", 0.012, 0.001, 3), best)[0].startswith("at chance")
    assert "1 seed" in recall.trust_notes(_entry("one", 0.5, None, 1), best)[0]
    assert recall.trust_notes(_entry("bag", 0.257, 0.007, 3), best)[0].startswith("at the in-context guess (0.250")
    bound = recall.trust_notes(_entry("bound", 0.33, 0.01, 3), best)  # 0.33 is past 0.25 + 3 standard errors
    assert not any("guess" in note or "chance" in note for note in bound)
    assert recall.accuracy_cell(0.5, None, 1) == "0.500 (1 seed)"
    assert recall.accuracy_cell(0.5, 0.1, 3) == "0.500 ± 0.100"


# --- passkey ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys():
    from zoo.data import passkey

    return passkey.build(context_length=256, num_train_examples=20, num_validation_examples=4, num_test_examples=10)


def test_passkey_answer_is_the_needle_and_labels_only_there(keys):
    for row in keys["test"]:
        ids, labels, distance = row["input_ids"], row["labels"], row["distance"]
        assert len(ids) == 256
        answer = [p for p, label in enumerate(labels) if label != IGNORE_INDEX]
        assert answer == list(range(251, 256))  # the 5 digits at the end, nothing else labelled
        key = bytes(ids[p] for p in answer).decode()
        assert key.isdigit() and f"The pass key is {key}. Remember it." in bytes(ids).decode("latin-1")
        for p in answer:
            assert ids[p - distance[p]] == ids[p]  # `distance` points at the same digit in the needle


def test_passkey_test_depths_cycle_and_text_is_held_out(keys):
    from zoo.data import passkey

    assert keys["test"]["depth"] == [0.0, 0.25, 0.5, 0.75, 1.0] * 2
    distances = [row["distance"][-1] for row in keys["test"]][:5]
    assert distances == sorted(distances, reverse=True)  # deeper needle: nearer the question
    train_text = b" ".join(passkey.book_bytes(test=False))
    assert bytes(keys["test"][4]["input_ids"][:40]) not in train_text  # depth 1: filler first, from held-out books
    again = passkey.build(context_length=256, num_train_examples=20, num_validation_examples=4, num_test_examples=10)
    assert again["train"]["input_ids"] == keys["train"]["input_ids"]


def test_passkey_mixes_train_lengths_and_tests_at_the_full_context():
    from zoo.data import passkey

    mixed = passkey.build(context_length=256, num_train_examples=40, num_validation_examples=4, num_test_examples=5,
                          min_train_context_length=128)
    lengths = [len(ids) for ids in mixed["train"]["input_ids"]]
    assert min(lengths) >= 128 and max(lengths) <= 256 and len(set(lengths)) > 10
    assert {len(ids) for split in ("validation", "test") for ids in mixed[split]["input_ids"]} == {256}
    for row in mixed["train"]:  # every length keeps the answer at its end, pointing back at the needle
        ids, labels, distance = row["input_ids"], row["labels"], row["distance"]
        answer = list(range(len(ids) - 5, len(ids)))
        assert [p for p, label in enumerate(labels) if label != IGNORE_INDEX] == answer
        assert all(ids[p - distance[p]] == ids[p] for p in answer)
    with pytest.raises(ValueError, match="min_train_context_length=512 must lie in"):
        passkey.build(context_length=256, min_train_context_length=512)


def test_report_table_names_hybrid_layers_and_drops_empty_buckets():
    buckets = [
        {"bucket": "[1,2)", "start": 1, "end": 2, "answers": 0, "accuracy": None, "std": None, "seeds": 0},
        {"bucket": "[2,4)", "start": 2, "end": 4, "answers": 9, "accuracy": 0.5, "std": 0.1, "seeds": 3},
    ]
    row = {
        **_entry("mix", 0.5, 0.1, 3),
        "variant_params": {
            "layers": [{"variant": "longformer", "params": {"window": 16}}, {"variant": "linear", "params": {}}]
        },
        "max_length": 64,
        "decoding_state_bytes": 12544.0,
        "train_tokens_per_second": 1000.0,
        "wall_time_seconds": 30.0,
        "status": "ok",
        "accuracy_by_distance": buckets,
    }
    text = "\n".join(recall.report_tables([row]))
    assert "| mix | longformer(window=16), linear | – | 64 | 0.500 ± 0.100 | – | – | 12,544 |" in text
    assert "[2,4) (n=9)" in text and "[1,2)" not in text


def test_bubble_chart_names_entries_in_a_legend_and_maps_areas_to_megabytes():
    from zoo.reporting import pyplot
    from zoo.training.compare import bubble_chart

    rows = [
        {"name": name, "eval_accuracy": acc, "peak_memory_mb": mb, "train_tokens_per_second": speed}
        for name, acc, mb, speed in [
            ("sdpa", 0.35, 900, 1000), ("longformer", 0.352, 950, 1010), ("linear", 0.2, 500, 2000)
        ]
    ]
    fig, ax = pyplot().subplots()
    bubble_chart(ax, rows, "eval_accuracy")
    legends = [a for a in ax.get_children() if type(a).__name__ == "Legend"]
    texts = [[t.get_text() for t in legend.get_texts()] for legend in legends]
    assert ["sdpa", "longformer", "linear"] in texts  # overlapping bubbles stay identifiable
    assert any(all(t.endswith(" MB") for t in group) and len(group) >= 2 for group in texts)  # a size legend
    pyplot().close(fig)


def test_report_header_names_the_seeds_each_task_ran():
    from zoo.training.compare import markdown_report

    cfg = {"launcher": None, "seeds": [42], "tasks": [{"name": "mqar", "seeds": [0, 1, 2]}, {"name": "listops"}]}
    header = markdown_report(cfg, [], "c.yaml", 1.0)
    assert "seeds: mqar [0, 1, 2], listops [42]" in header
