"""Recall tasks (MQAR, passkey): accuracy per answer token, accuracy by query-key distance, decoding state bytes,
and their part of a comparison report (tables that say when they cannot be trusted, the recall-memory frontier).

A recall task's examples hold ``input_ids``, ``labels`` (-100 except at the answer tokens) and ``distance`` (how
far before the query its key stands, -1 off the answers). Distance buckets: [1,2), [2,4), [4,8), ... up to the
sequence length: a causal window of reach r answers the buckets below r and fails above (the step at the window).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import torch

from zoo.cache import cache_nbytes
from zoo.call import AttentionCall
from zoo.data.labels import IGNORE_INDEX
from zoo.registry import get_variant_class
from zoo.reporting import fixed, markdown_table, save_figure

CHANCE_SIGMAS = 3  # an accuracy within this many binomial standard errors of the majority answer's share: at chance


# ---------------------------------------------------------------------------------------------------
# training and evaluation (zoo.training.finetune)


def distance_buckets(max_distance: int) -> list[tuple[int, int]]:
    """``[(1, 2), (2, 4), (4, 8), ...]`` covering distances 1 .. max_distance."""
    buckets, start = [], 1
    while start <= max_distance:
        buckets.append((start, 2 * start))
        start *= 2
    return buckets


def predicted_tokens(logits, labels: torch.Tensor) -> torch.Tensor:
    """``preprocess_logits_for_metrics``: the greedy token predicted for each position (the logits at p - 1), -100
    at position 0. Keeps only (batch, n) ids, never the vocabulary-sized logits."""
    logits = logits[0] if isinstance(logits, tuple) else logits
    return torch.nn.functional.pad(logits[:, :-1].argmax(-1), (1, 0), value=IGNORE_INDEX)


class RecallAccuracy:
    """compute_metrics for Trainer: accuracy over the answer tokens, the majority answer's share (the accuracy of
    always giving the most frequent answer), the in-context guess (the accuracy of knowing which answers a sequence
    holds but not which query each belongs to: 1 / its distinct answers, e.g. 1/4 with 4 MQAR pairs) and accuracy per
    distance bucket (kept in ``by_distance``).

    The distances come from the evaluation examples themselves; Trainer gathers predictions in dataset order,
    which is checked against the examples' labels (a mismatch is an error, never a misattributed bucket).
    """

    def __init__(self, eval_examples) -> None:
        self.labels = np.asarray(eval_examples["labels"])
        self.distance = np.asarray(eval_examples["distance"])
        self.buckets = distance_buckets(int(self.distance.max()))
        self.by_distance: list[dict] = []

    def __call__(self, eval_pred) -> dict[str, float]:
        predictions, labels = np.asarray(eval_pred.predictions), np.asarray(eval_pred.label_ids)
        if labels.shape != self.labels.shape or not np.array_equal(labels, self.labels):
            raise RuntimeError(
                "recall metrics: the gathered labels are not the evaluation examples in order, so distances cannot "
                f"be matched to answers (got shape {labels.shape}, expected {self.labels.shape})."
            )
        answer = labels != IGNORE_INDEX
        correct = (predictions == labels) & answer
        _, counts = np.unique(labels[answer], return_counts=True)
        self.by_distance = []
        for start, end in self.buckets:
            in_bucket = answer & (self.distance >= start) & (self.distance < end)
            count = int(in_bucket.sum())
            self.by_distance.append({"bucket": f"[{start},{end})", "start": start, "end": end, "answers": count,
                                     "accuracy": float(correct[in_bucket].mean()) if count else None})  # fmt: skip
        distinct = np.array([len(np.unique(row[mask])) for row, mask in zip(labels, answer, strict=True)])
        guessed = (answer.sum(-1) / np.maximum(distinct, 1)).sum()  # expected hits of a uniform pick per sequence
        return {
            "accuracy": float(correct.sum() / answer.sum()),
            "majority_accuracy": float(counts.max() / answer.sum()),
            "guess_accuracy": float(guessed / answer.sum()),
            "answers": int(answer.sum()),
        }


def decoding_state_bytes(model, input_ids: list[int]) -> int:
    """Bytes the decoding cache holds for one sequence after ``generate`` read ``input_ids`` (batch 1)."""

    model.eval()
    prompt = torch.tensor([input_ids], device=model.device)
    with torch.inference_mode():
        output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1, do_sample=False,
                                pad_token_id=model.config.pad_token_id, return_dict_in_generate=True)  # fmt: skip
    return cache_nbytes(output.past_key_values)


def outcome(out: Path, computer: RecallAccuracy, metrics: dict, eval_examples) -> dict:
    """results.json's part for a recall task; the state bytes come from the saved folder, loaded back."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    return {
        "metrics": {key: float(metrics[key]) for key in ("eval_accuracy", "eval_loss")},
        "majority_accuracy": float(metrics["eval_majority_accuracy"]),
        "guess_accuracy": float(metrics["eval_guess_accuracy"]),
        "answers": int(metrics["eval_answers"]),
        "accuracy_by_distance": computer.by_distance,
        "decoding_state_bytes": decoding_state_bytes(model, eval_examples[0]["input_ids"]),
        "decoding_state_length": len(eval_examples[0]["input_ids"]),
    }


# ---------------------------------------------------------------------------------------------------
# comparison report (zoo.training.compare)


def summary_fields(done: list[dict]) -> dict:
    """Recall fields of one comparison entry from its finished seeds' rows: means, and stds by bucket."""
    fields = {"decoding_state_bytes": _mean([r.get("decoding_state_bytes") for r in done]),
              "majority_accuracy": _mean([r.get("majority_accuracy") for r in done]),
              "guess_accuracy": _mean([r.get("guess_accuracy") for r in done]),
              "answers": _mean([r.get("answers") for r in done])}  # fmt: skip
    fields["seed_accuracies"] = [(r.get("seed"), r["eval_accuracy"]) for r in done
                                 if r.get("eval_accuracy") is not None]
    layers = next((r["num_layers"] for r in done if r.get("num_layers")), None)
    fields["num_layers"] = layers
    fields["receptive_field"] = receptive_field(done[0]["variant"], done[0].get("variant_params") or {}, layers) \
        if done and layers else None
    runs = [r["accuracy_by_distance"] for r in done if r.get("accuracy_by_distance")]
    fields["accuracy_by_distance"] = None
    if runs:
        merged = []
        for buckets in zip(*runs, strict=True):
            values = [b["accuracy"] for b in buckets if b["accuracy"] is not None]
            merged.append({**buckets[0], "accuracy": _mean(values), "std": _std(values), "seeds": len(values)})
        fields["accuracy_by_distance"] = merged
    return fields


def receptive_field(variant: str, params: dict, layers: int) -> int | None:
    """How far back (tokens) the last layer's output can see through ``layers`` stacked causal layers: the sum of
    each layer's pattern reach (a window reaches ``reach`` tokens per layer, so two layers reach twice as far; a
    hybrid adds its layers' own reaches); None (unbounded) when any layer sees every earlier token (full attention, a
    recurrent state, a pattern without a finite reach). Sinks (global tokens) are not counted."""
    instance = get_variant_class(variant)(**params)
    total = 0
    for layer in range(layers):
        call = AttentionCall(causal=True, scaling=1.0, layer_idx=layer, decoding=True)
        pattern = instance.pattern(call, 1, 1) if instance.exact else None
        if pattern is None or pattern.reach is None:
            return None
        total += pattern.reach
    return total


def split_at_field(buckets: list[dict] | None, field: int | None) -> dict | None:
    """Accuracy (weighted by answers) of the distance buckets within ``field`` (every distance <= field) and beyond
    it (every distance > field but the boundary itself: a bucket starting at the field counts as beyond); a bucket
    that straddles it otherwise is named apart. None without a finite field or buckets."""
    if field is None or not buckets:
        return None
    parts = {"within": [], "beyond": [], "straddles": []}
    for b in buckets:
        if not b.get("answers") or b.get("accuracy") is None:
            continue
        side = "within" if b["end"] - 1 <= field else "beyond" if b["start"] >= field else "straddles"
        parts[side].append(b)

    def weighted(part: list[dict]) -> float | None:
        answers = sum(b["answers"] for b in part)
        return sum(b["accuracy"] * b["answers"] for b in part) / answers if answers else None

    return {"within": weighted(parts["within"]), "within_answers": sum(b["answers"] for b in parts["within"]),
            "beyond": weighted(parts["beyond"]), "beyond_answers": sum(b["answers"] for b in parts["beyond"]),
            "straddles": [b["bucket"] for b in parts["straddles"]]}  # fmt: skip


def welch(a: list[float], b: list[float]) -> tuple[float, float, float] | None:
    """Welch's unequal-variance t-test of two samples: (t, degrees of freedom, two-sided p); None when either has
    fewer than 2 values or both have no spread."""
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return None
    t = (statistics.fmean(a) - statistics.fmean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return t, df, _student_two_sided_p(t, df)


def _student_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom: the regularized incomplete beta
    I_{df/(df+t²)}(df/2, 1/2) (continued fraction, Numerical Recipes' betacf)."""
    x, a, b = df / (df + t * t), df / 2, 0.5
    if x <= 0:
        return 0.0
    if x >= 1:  # t = 0 (equal means): every |T| is at least 0
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x >= (a + 1) / (a + b + 2):  # the symmetric relation converges faster there
        return 1.0 - front * _beta_fraction(1 - x, b, a) / b
    return front * _beta_fraction(x, a, b) / a


def _beta_fraction(x: float, a: float, b: float) -> float:
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    value = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            value *= c * d
        if abs(c * d - 1) < 1e-12:
            break
    return value


STALL_SIGMAS = 3  # a seed this many (the other seeds' std, at least STALL_FLOOR) below their mean stalls
STALL_FLOOR = 0.01


def stalled_seeds(seeds: list[tuple]) -> list[tuple]:
    """The (seed, accuracy) pairs far below the entry's other seeds: more than STALL_SIGMAS times their standard
    deviation (at least STALL_FLOOR) under their mean -- one seed that did not learn inflates the entry's spread."""
    stalled = []
    for index, (seed, accuracy) in enumerate(seeds):
        others = [a for i, (_, a) in enumerate(seeds) if i != index]
        if len(others) < 2:
            continue
        spread = max(statistics.stdev(others), STALL_FLOOR)
        if statistics.fmean(others) - accuracy > STALL_SIGMAS * spread:
            stalled.append((seed, accuracy))
    return stalled


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _std(values: list) -> float | None:
    return statistics.stdev(values) if len(values) > 1 else None


def at_chance(row: dict, baseline: str = "majority_accuracy") -> bool:
    """Mean accuracy within CHANCE_SIGMAS binomial standard errors of a baseline's accuracy (or below it): always
    giving the most frequent answer (``majority_accuracy``), or guessing among the sequence's own answers
    (``guess_accuracy``)."""
    accuracy, level, answers = row.get("eval_accuracy"), row.get(baseline), row.get("answers")
    if accuracy is None or level is None or not answers:
        return False
    return accuracy <= level + CHANCE_SIGMAS * math.sqrt(level * (1 - level) / answers)


def accuracy_cell(mean: float | None, std: float | None, seeds: int) -> str:
    """``0.953 ± 0.012`` over several seeds; ``0.953 (1 seed)`` with one: no spread is claimed."""
    if mean is None:
        return "–"
    return f"{mean:.3f} ± {std:.3f}" if seeds > 1 and std is not None else f"{mean:.3f} (1 seed)"


SIGNIFICANCE = 0.05  # Welch's two-sided p at or above this: not distinguishable from the best


def trust_notes(row: dict, best: dict | None) -> list[str]:
    """What a reader must know before comparing this entry: at chance, one seed, a stalled seed, and Welch's t-test
    of its seeds' accuracies against the best entry's (p >= SIGNIFICANCE: not distinguishable from it)."""
    notes = []
    if at_chance(row):
        notes.append(f"at chance (majority answer {row['majority_accuracy']:.3f})")
    elif at_chance(row, "guess_accuracy"):
        notes.append(f"at the in-context guess ({row['guess_accuracy']:.3f}: which answers the sequence holds, not "
                     "which query each belongs to)")
    seeds = row.get("seed_accuracies") or []
    for seed, accuracy in stalled_seeds(seeds):
        others = [a for s, a in seeds if s != seed]
        notes.append(f"seed {seed} stalls ({accuracy:.3f} against {min(others):.3f}–{max(others):.3f} of the others)")
    if row["seeds_ok"] < 2:
        notes.append("1 seed: no spread, differences untested")
    elif best is not None and best is not row and best["seeds_ok"] > 1:
        reference = [a for _, a in best.get("seed_accuracies") or []]
        stalled = {seed for seed, _ in stalled_seeds(seeds)}
        for label, values in (("", [a for _, a in seeds]),
                              (f"without the stalled seed{'s' if len(stalled) > 1 else ''} ",
                               [a for s, a in seeds if s not in stalled] if stalled else None)):
            test = welch(reference, values) if values else None
            if test is not None:
                t, df, p = test
                verdict = "not distinguishable from" if p >= SIGNIFICANCE else "below"
                notes.append(f"{label}{verdict} the best ({best['name']}): Welch's t = {t:.2f}, df = {df:.1f}, "
                             f"p = {p:.3g}")
    return notes


def field_text(row: dict) -> str:
    """The entry's receptive field: ``32 (2 layers)``, or ``unbounded``."""
    field = row.get("receptive_field")
    if field is None:
        return "unbounded" if row.get("num_layers") else "–"
    return f"{field} ({row['num_layers']} layers)"


def split_text(row: dict) -> str:
    """Accuracy within / beyond the receptive field: ``0.79 (n=1555) / 0.028 (n=445)``."""
    split = split_at_field(row.get("accuracy_by_distance"), row.get("receptive_field"))
    if split is None:
        return "–"
    cells = [f"{split[side]:.3f} (n={split[f'{side}_answers']})" if split[side] is not None else "–"
             for side in ("within", "beyond")]
    straddles = f"; {', '.join(split['straddles'])} straddles it" if split["straddles"] else ""
    return " / ".join(cells) + straddles


def report_tables(rows: list[dict]) -> list[str]:
    """The recall table (accuracy, state bytes, speed, notes) and accuracy by query-key distance bucket."""

    done = [r for r in rows if r["eval_accuracy"] is not None]
    best = max(done, key=lambda r: r["eval_accuracy"], default=None)
    header = ["variant", "params", "lr", "seq len", "accuracy", "receptive field", "within / beyond it",
              "decoding state / seq (bytes)", "train tok/s", "wall s", "status", "notes"]  # fmt: skip
    table = [
        [r["name"], params_text(r["variant_params"]), rate_text(r), r["max_length"],
         accuracy_cell(r["eval_accuracy"], r["eval_accuracy_std"], r["seeds_ok"]), field_text(r), split_text(r),
         fixed(r.get("decoding_state_bytes"), 0, grouping=True),
         fixed(r["train_tokens_per_second"], 0, grouping=True), fixed(r["wall_time_seconds"], 0), r["status"],
         "; ".join(trust_notes(r, best)) or "–"]
        for r in rows
    ]  # fmt: skip
    lines = markdown_table(header, table, align="llrrrrrrrrll")
    lines += ["", "Receptive field: how far back the last layer sees through the stacked layers (the sum of each "
              "layer's reach; unbounded with a full-attention or recurrent layer); within / beyond: accuracy over the "
              "distance buckets inside it and past it (a bucket that starts at the field counts as past it). Notes "
              "test each entry's seeds against the best's "
              f"with Welch's t (two-sided; p >= {SIGNIFICANCE} reads \"not distinguishable\"), and name a seed "
              f"more than {STALL_SIGMAS} times the others' std (at least {STALL_FLOOR}) below their mean as stalled."]
    buckets = [b for b in max((r.get("accuracy_by_distance") or [] for r in rows), key=len) if b["answers"]]
    if buckets:
        lines += ["", "Accuracy by query-key distance (tokens from the key to its query; answers per bucket in the "
                  "header, mean ± std over seeds):", ""]  # fmt: skip
        table = []
        for r in rows:
            cells = {b["bucket"]: b for b in r.get("accuracy_by_distance") or []}
            table.append([r["name"], *(accuracy_cell(cells[b["bucket"]]["accuracy"], cells[b["bucket"]]["std"],
                                                     cells[b["bucket"]]["seeds"]) if b["bucket"] in cells else "–"
                                       for b in buckets)])  # fmt: skip
        header = ["variant", *(f"{b['bucket']} (n={b['answers']})" for b in buckets)]
        lines += markdown_table(header, table, align="l" + "r" * len(buckets))
    return lines


def rate_text(row: dict) -> str:
    """The entry's learning rate: ``0.003``; chosen by a sweep: ``0.003 (swept)`` (see the sweeps section)."""
    rate = row.get("learning_rate")
    if rate is None:
        return "–"
    note = row.get("learning_rate_note")
    return f"{rate:g} ({note})" if note else f"{rate:g}"


def params_text(params: dict) -> str:
    """``window=16``; a hybrid's layers as ``longformer(window=16), linear``."""
    if "layers" in params:
        return ", ".join(
            entry["variant"] + (f"({params_text(entry['params'])})" if entry.get("params") else "")
            if isinstance(entry, dict) else str(entry)
            for entry in params["layers"]
        )  # fmt: skip
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "–"


def plot_frontier(plt, task: str, rows: list[dict], path: Path) -> None:
    """Accuracy against decoding state bytes per sequence (log x), one point per entry, error bars over seeds."""

    fig, ax = plt.subplots(figsize=(7, 5))
    for r in rows:
        if r["eval_accuracy"] is None or not r.get("decoding_state_bytes"):
            continue
        ax.errorbar(r["decoding_state_bytes"], r["eval_accuracy"], yerr=r["eval_accuracy_std"] or None, fmt="o",
                    capsize=3)  # fmt: skip
        ax.annotate(r["name"], (r["decoding_state_bytes"], r["eval_accuracy"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)  # fmt: skip
    draw_baselines(ax, rows)
    ax.set_xscale("log")
    ax.set(xlabel="decoding state per sequence at the task length (bytes, log)", ylabel="accuracy",
           title=f"{task}: recall vs decoding state (the frontier)", ylim=(-0.02, 1.02))  # fmt: skip
    save_figure(fig, path)


def draw_baselines(ax, rows: list[dict]) -> None:
    """Dotted lines at the accuracy of the majority answer and of the in-context guess (means over the entries)."""
    for key, text in (("majority_accuracy", "majority answer"), ("guess_accuracy", "in-context guess")):
        level = _mean([r.get(key) for r in rows])
        if level is not None:
            ax.axhline(level, color="gray", linestyle=":", linewidth=1)
            ax.annotate(f"{text} {level:.3f}", (0.99, level), xycoords=("axes fraction", "data"), ha="right",
                        xytext=(0, 2), textcoords="offset points", fontsize=7, color="gray")  # fmt: skip


def plot_by_distance(plt, task: str, rows: list[dict], path: Path) -> None:
    """Accuracy per query-key distance bucket, one line per entry (x: bucket, log-spaced)."""

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ticks = {}
    for r in rows:
        buckets = [b for b in r.get("accuracy_by_distance") or [] if b["accuracy"] is not None]
        if buckets:
            middle = [(b["start"] * (b["end"] - 1)) ** 0.5 for b in buckets]
            ticks.update(zip(middle, (b["bucket"] for b in buckets), strict=True))
            ax.plot(middle, [b["accuracy"] for b in buckets], marker="o", label=r["name"])
    draw_baselines(ax, rows)
    ax.set_xscale("log")
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.minorticks_off()
    ax.set(xlabel="query-key distance (tokens)", ylabel="accuracy", title=f"{task}: accuracy by query-key distance",
           ylim=(-0.02, 1.02))  # fmt: skip
    if ax.lines:
        ax.legend(fontsize=8)
    save_figure(fig, path)
