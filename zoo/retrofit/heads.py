"""Choosing the KV heads that keep the whole cache (the ``duo`` layouts: ``zoo.configure(model, "duo", full_heads=)``):
synthetic multi-passkey prompts the zoo makes offline (:func:`passkey_prompts`; :func:`filler_passkey_prompts`, the
passkey benchmark's kind), the top share of heads by a score (:func:`choose_full_heads`) and a picture of the scores
(:func:`plot_heads_map`).

The prompts follow DuoAttention's training data (mit-han-lab/duo-attention ``duo_attn/data.py``): passkeys of NATO
words ("alpha bravo ...") filed as the first, second, ... passkey to a vault, hidden at random depths of a long book
(the Gutenberg *train* books here; ``zoo eval`` draws its haystacks from the test books and a noise passage), then each
question followed by its passkey. The gate loss compares hidden states on that question-and-answer tail.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path

import torch
import yaml
from huggingface_hub import ModelCard, ModelCardData
from transformers import AutoConfig

from zoo.bench.passkey import prompt_parts
from zoo.data.gutenberg import build_lm
from zoo.eval.contestants import hub_id, load_model, model_path
from zoo.plug.install import configure
from zoo.registry import get_variant_class, list_variants
from zoo.reporting import append_jsonl, pyplot, relative_path, save_figure
from zoo.retrofit.duo_gates import (
    GATED,
    DuoGates,
    GateSettings,
    Retrieval,
    attention,
    needle_mass,
    shape_of,
    swap_kl,
    train_gates,
    with_kwargs,
)
from zoo.retrofit.recipe import book_sequences
from zoo.retrofit.selection import divergence, next_token_logprobs

logger = logging.getLogger("zoo.retrofit.heads")
_DUO_PARAMS = get_variant_class("duo").params  # the layouts' defaults: the variant's own, stated once

ALPHABET = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett", "kilo",
            "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor",
            "whiskey", "xray", "yankee", "zulu")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
HEAD = "This is a very long story book: <book>"
TAIL = " </book>.\n\n"
NEEDLE = "Remember this sequence of words, it's the {ordinal} passkey to the vault:"
QUESTION = "Based on the content of the book, what is the {ordinal} passkey to the vault?\nPasskey:"
SEPARATOR = "\n\n"
MIN_HAYSTACK = 64
WORDS_PER_BOOK = 40_000  # the first words of each train book: plenty of haystack, a quick tokenization


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


@lru_cache(maxsize=2)
def _train_books(tokenizer) -> tuple[tuple[int, ...], ...]:
    """Token ids of the Gutenberg LM *train* books (never the validation or test books)."""
    texts = build_lm(max_words_per_book=WORDS_PER_BOOK)["train"]["text"]
    return tuple(tuple(ids) for ids in tokenizer(list(texts), add_special_tokens=False).input_ids)


def passkey_prompts(tokenizer, count: int, lengths: Sequence[int], passkeys: int, words: int,
                    seed: int) -> list[Retrieval]:
    """``count`` prompts of a length drawn from ``lengths`` = [least, most] tokens, each hiding ``passkeys`` passkeys
    of ``words`` NATO words at sorted random depths in 0.05..0.95 of a train-book stretch, then asking for each in
    turn with its answer. Deterministic in ``seed``."""
    if not 1 <= passkeys <= len(ORDINALS):
        raise ValueError(f"data.passkeys={passkeys}; use 1 to {len(ORDINALS)}.")
    rng = random.Random(seed)
    books = _train_books(tokenizer)
    head, tail, gap = _encode(tokenizer, HEAD), _encode(tokenizer, TAIL), _encode(tokenizer, SEPARATOR)
    prompts = []
    for _ in range(count):
        length = rng.randint(min(lengths), max(lengths))
        keys = [" ".join(rng.choice(ALPHABET) for _ in range(words)) for _ in range(passkeys)]
        needles = [_encode(tokenizer, NEEDLE.format(ordinal=ORDINALS[i])) + _encode(tokenizer, " " + key)
                   for i, key in enumerate(keys)]
        questions = [_encode(tokenizer, QUESTION.format(ordinal=ORDINALS[i])) for i in range(passkeys)]
        answers = [_encode(tokenizer, " " + key) for key in keys]
        tail_len = sum(len(q) + len(a) + len(gap) for q, a in zip(questions, answers, strict=True))
        room = length - len(head) - len(tail) - sum(len(n) + 2 * len(gap) for n in needles) - tail_len
        if room < MIN_HAYSTACK:
            raise ValueError(f"data: {passkeys} passkeys of {words} words leave {room} haystack tokens at length "
                             f"{length}; raise data.lengths or lower data.passkeys / data.words.")
        book = rng.choice([b for b in books if len(b) > room])
        start = rng.randrange(len(book) - room)
        hay = list(book[start : start + room])
        depths = sorted(rng.uniform(0.05, 0.95) for _ in range(passkeys))
        ids, spans, cursor = list(head), [], 0
        for depth, needle in zip(depths, needles, strict=True):
            point = int(depth * room)
            ids += hay[cursor:point] + gap
            spans.append((len(ids), len(ids) + len(needle)))
            ids += needle + gap
            cursor = point
        ids += hay[cursor:] + tail
        qa_start, rows = len(ids), []
        for question, answer in zip(questions, answers, strict=True):
            ids += question
            rows.append(list(range(len(ids) - 1, len(ids) + len(answer) - 1)))  # each row predicts an answer token
            ids += answer + gap
        prompts.append(Retrieval(ids=ids, loss_rows=list(range(qa_start, len(ids))), answer_rows=rows,
                                 needles=spans, meta={"keys": keys, "depths": depths, "book_start": start}))
    return prompts


def filler_passkey_prompts(tokenizer, count: int, lengths: Sequence[int], seed: int) -> list[Retrieval]:
    """``count`` prompts of the passkey benchmark's kind (:mod:`zoo.bench.passkey`: a 5-digit key in repeated filler,
    asked for at the end), each followed by its answer, of a length drawn from ``lengths`` = [least, most], the needle
    at a random depth in 0.05..0.95. Keys, depths and lengths come from ``seed`` (``zoo eval`` draws its own)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length, depth = rng.randint(min(lengths), max(lengths)), rng.uniform(0.05, 0.95)
        key = rng.randrange(10**4, 10**5)
        answer = _encode(tokenizer, f" {key}")
        ids, needle = prompt_parts(tokenizer, length - len(answer), depth, key)
        rows = list(range(len(ids) - 1, len(ids) + len(answer) - 1))  # each row predicts an answer token
        prompts.append(Retrieval(ids=ids + answer, loss_rows=rows, answer_rows=[rows], needles=[needle],
                                 meta={"key": key, "depth": depth}))
    return prompts


def choose_full_heads(scores: torch.Tensor, fraction: float) -> list[list[int]]:
    """The ``full_heads`` lists (one per layer) of the top ``fraction`` of all KV heads by ``scores`` (layers, KV
    heads), ranked across the whole model (DuoAttention's deployment thresholding): at least
    ``round(fraction * total)`` heads (at least one), and every head tied with the last one chosen."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fractions: {fraction!r} is outside (0, 1]; give the share of KV heads that keep the whole "
                         "cache, e.g. fractions: [0.1, 0.25, 0.5].")
    if scores.dim() != 2 or scores.numel() == 0:
        raise ValueError(f"scores must be (layers, KV heads); got shape {tuple(scores.shape)}.")
    flat = scores.detach().float().flatten()
    count = max(1, round(fraction * flat.numel()))
    threshold = flat.topk(count).values[-1]
    return [torch.nonzero(row >= threshold).flatten().tolist() for row in scores.detach().float()]


def count_heads(full_heads: list[list[int]]) -> int:
    return sum(len(heads) for heads in full_heads)


def plot_heads_map(scores: Mapping[str, torch.Tensor], chosen: Mapping[str, Mapping[str, list[list[int]]]],
                   path: str | Path, title: str = "") -> None:
    """One heatmap per method (KV heads × layers); each chosen head is marked with the least kept share (%) that
    chooses it."""
    names = list(scores)
    figure, axes = pyplot().subplots(len(names), 1, figsize=(11, 1.2 + 1.5 * len(names)), squeeze=False)
    for axis, name in zip(axes[:, 0], names, strict=True):
        table = scores[name].float()
        image = axis.imshow(table.T.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
        figure.colorbar(image, ax=axis, fraction=0.02, pad=0.01)
        least: dict[tuple[int, int], str] = {}
        for fraction, layout in sorted(chosen.get(name, {}).items(), key=lambda item: -float(item[0])):
            for layer, heads in enumerate(layout):
                for head in heads:
                    least[layer, head] = f"{round(float(fraction) * 100)}"
        for (layer, head), label in least.items():
            axis.text(layer, head, label, ha="center", va="center", fontsize=7, color="white",
                      bbox={"boxstyle": "round,pad=0.1", "fc": "black", "alpha": 0.5, "lw": 0})
        axis.set_ylabel(f"{name}\nKV head")
        axis.set_yticks(range(table.shape[1]))
        axis.set_xticks(range(table.shape[0]))
        axis.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("layer (a number: the least kept share, %, that keeps the head full)")
    if title:
        axes[0, 0].set_title(title)
    save_figure(figure, path, dpi=120)


# ---------------------------------------------------------------- the recipe (recipes/duo.py CONFIG)


TOP_KEYS = {"model", "output_dir", "seed", "threads", "device", "dtype", "sinks", "recent", "fractions", "data",
            "gates", "swap_kl", "held_out", "save_models"}
DATA_DEFAULTS = {"lengths": [1024, 1536], "passkeys": 4, "words": 16, "train_prompts": 32, "calibration_prompts": 8,
                 "passkey_prompts": 0}  # passkey_prompts: filler-passkey calibration prompts (0: no needle_passkey)
GATE_KEYS = {f.name for f in fields(GateSettings)} - {"seed"}
HELD_OUT_DEFAULTS = {"sequences": 2, "length": 2048}  # KL of each layout on the validation book (swap KL: the same)


class DuoConfigError(ValueError):
    """A ``recipes/duo.py`` config that cannot run; the message names the key and the fix."""


@dataclass
class DuoConfig:
    model: str
    output_dir: Path
    seed: int = 1234
    threads: int | None = None
    device: str | None = None
    dtype: str | None = None
    sinks: int = _DUO_PARAMS["sinks"].default
    recent: int = _DUO_PARAMS["recent"].default
    fractions: list[float] = field(default_factory=lambda: [0.1, 0.25, 0.5])
    data: dict = field(default_factory=lambda: dict(DATA_DEFAULTS))
    gates: GateSettings = field(default_factory=GateSettings)
    swap_kl: bool = False
    held_out: dict = field(default_factory=lambda: dict(HELD_OUT_DEFAULTS))
    save_models: bool = True
    source: dict = field(default_factory=dict)


def _block(raw: dict, key: str, defaults: dict, path) -> dict:
    block = raw.get(key) or {}
    if not isinstance(block, dict) or set(block) - set(defaults):
        raise DuoConfigError(f"{path}: {key} takes {sorted(defaults)}; got {block!r}.")
    return {**defaults, **block}


def _whole(path, key: str, value, least: int, most: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (most is not None and value > most):
        span = f">= {least}" if most is None else f"from {least} to {most} (the model's positions)"
        raise DuoConfigError(f"{path}: {key}={value!r}; use a whole number {span}.")
    return value


def load_config(path: str | Path, overrides: dict | None = None) -> DuoConfig:
    """Read and check a DuoAttention heads config before any model loads (unknown keys, fractions outside (0, 1],
    negative sinks / recent or more than the model's positions)."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise DuoConfigError(f"{path}: unknown keys {unknown}; known: {', '.join(sorted(TOP_KEYS))}.")
    for key in ("model", "output_dir"):
        if key not in raw:
            raise DuoConfigError(f"{path}: `{key}` is missing.")
    positions = int(getattr(AutoConfig.from_pretrained(model_path(str(raw["model"]))), "max_position_embeddings", 0)
                    or 2**31)  # fmt: skip
    sinks = _whole(path, "sinks", raw.get("sinks", DuoConfig.sinks), 0, positions)
    recent = _whole(path, "recent", raw.get("recent", DuoConfig.recent), 1, positions)
    fractions = raw.get("fractions", [0.1, 0.25, 0.5])
    if not isinstance(fractions, list) or not fractions:
        raise DuoConfigError(f"{path}: fractions={fractions!r}; give a list of shares in (0, 1], e.g. [0.1, 0.25].")
    for fraction in fractions:
        try:
            choose_full_heads(torch.zeros(1, 1), fraction)
        except ValueError as exc:
            raise DuoConfigError(f"{path}: {exc}") from exc
    data = _block(raw, "data", DATA_DEFAULTS, path)
    lengths = data["lengths"]
    if not isinstance(lengths, list) or len(lengths) != 2 or not all(isinstance(n, int) for n in lengths) \
            or not 0 < min(lengths) <= max(lengths) <= positions:
        raise DuoConfigError(f"{path}: data.lengths={lengths!r}; give [least, most] tokens within the model's "
                             f"{positions} positions, e.g. [1024, 1536].")
    for key in ("passkeys", "words", "train_prompts", "calibration_prompts"):
        _whole(path, f"data.{key}", data[key], 1)
    _whole(path, "data.passkey_prompts", data["passkey_prompts"], 0)
    gates = raw.get("gates") or {}
    if not isinstance(gates, dict) or set(gates) - GATE_KEYS:
        raise DuoConfigError(f"{path}: gates takes {sorted(GATE_KEYS)}; got {gates!r}.")
    _whole(path, "gates.steps", gates.get("steps", GateSettings.steps), 0)  # 0: no trained gates
    if gates.get("reg_reduction", GateSettings.reg_reduction) not in ("mean", "sum"):
        raise DuoConfigError(f"{path}: gates.reg_reduction={gates['reg_reduction']!r}; give 'mean' (λ·mean|α|, the "
                             "official code) or 'sum' (λ·Σ|α|, the paper's formula).")
    held_out = _block(raw, "held_out", HELD_OUT_DEFAULTS, path)
    return DuoConfig(model=str(raw["model"]), output_dir=Path(raw["output_dir"]), seed=int(raw.get("seed", 1234)),
                     threads=raw.get("threads"), device=raw.get("device"), dtype=raw.get("dtype"), sinks=sinks,
                     recent=recent, fractions=[float(f) for f in fractions], data=data,
                     gates=GateSettings(**gates, seed=int(raw.get("seed", 1234))),
                     swap_kl=bool(raw.get("swap_kl", False)), held_out=held_out,
                     save_models=bool(raw.get("save_models", True)), source=raw)


def scores_of(cfg: DuoConfig, model, tokenizer, log) -> tuple[dict[str, torch.Tensor], dict]:
    """Each method's (layers, KV heads) scores and what they cost: the trained gates (unless ``gates.steps`` is 0),
    the needle mass, and with ``data.passkey_prompts`` the larger of the needle mass and the mass on filler passkeys
    (``needle_passkey``: a head either kind of retrieval reads)."""
    data = cfg.data
    make = dict(lengths=data["lengths"], passkeys=data["passkeys"], words=data["words"])
    calibration = passkey_prompts(tokenizer, data["calibration_prompts"], seed=cfg.seed + 1, **make)
    scores, record = ({}, {}) if not cfg.gates.steps else _gate_scores(cfg, model, tokenizer, log, make)
    started = time.perf_counter()
    scores["needle"] = needle_mass(model, calibration)
    record["needle"] = {"prompts": len(calibration), "seed": cfg.seed + 1,
                        "tokens": sum(len(p.ids) for p in calibration), "minutes": (time.perf_counter() - started) / 60}
    if data["passkey_prompts"]:
        started = time.perf_counter()
        filler = filler_passkey_prompts(tokenizer, data["passkey_prompts"], data["lengths"], seed=cfg.seed + 2)
        scores["needle_passkey"] = torch.maximum(scores["needle"], needle_mass(model, filler))
        record["needle_passkey"] = {"prompts": len(filler), "seed": cfg.seed + 2,
                                    "tokens": sum(len(p.ids) for p in filler),
                                    "minutes": (time.perf_counter() - started) / 60}
    return scores, record


def _gate_scores(cfg: DuoConfig, model, tokenizer, log, make: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """DuoAttention's trained gates as scores, and their record."""
    train = passkey_prompts(tokenizer, cfg.data["train_prompts"], seed=cfg.seed, **make)
    trained = train_gates(model, train, cfg.gates, cfg.sinks, cfg.recent, log=log)
    steps = [row["seconds"] for row in trained["history"]]
    record = {
        "gates": {"settings": asdict(cfg.gates), "alpha": trained["alpha"].tolist(),
                  "mean_alpha": trained["mean_alpha"].tolist(), "history": trained["history"],
                  "prompts": len(train), "seed": cfg.seed, "tokens": sum(row["tokens"] for row in trained["history"]),
                  "prompt_tokens": [min(len(p.ids) for p in train), max(len(p.ids) for p in train)],
                  "step_seconds": {"mean": sum(steps) / len(steps), "min": min(steps), "max": max(steps)},
                  "minutes": trained["seconds"] / 60},
    }
    # ties at the clamp (many α end at 0 or 1) are broken by α averaged over the run
    return {"gates": trained["alpha"] + 1e-3 * trained["mean_alpha"]}, record


def layout_kl(cfg: DuoConfig, model, sequences: torch.Tensor, teacher: torch.Tensor, chosen: dict) -> dict:
    """Per method and share: the held-out next-token KL from the original (and perplexity) with that layout, run as
    the gated attention with α 1 on the chosen heads and 0 elsewhere (the ``duo`` layout's prefill)."""
    rows = {}
    with attention(model, GATED):
        for method, layouts in chosen.items():
            for fraction, full_heads in layouts.items():
                gates = DuoGates(*shape_of(model), cfg.sinks, cfg.recent, initial=0.0)
                for layer, heads in enumerate(full_heads):
                    gates.alpha.data[layer, heads] = 1.0
                rows[f"{method} {fraction}"] = divergence(with_kwargs(model, duo_gates=gates), sequences, teacher)
    return rows


def save_layouts(cfg: DuoConfig, model, tokenizer, chosen: dict) -> dict[str, str]:
    """One Hub-ready folder per (method, share) with ``zoo.configure(model, "duo", ...)``; {} while ``duo`` is not
    registered."""
    if not cfg.save_models or "duo" not in list_variants():
        return {}
    folders = {}
    for method, layouts in chosen.items():
        for fraction, full_heads in layouts.items():
            folder = cfg.output_dir / f"{method}_{fraction}"
            configure(model, "duo", full_heads=full_heads, sinks=cfg.sinks, recent=cfg.recent)
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            write_card(cfg, folder, method, fraction, full_heads)
            folders[f"{method} {fraction}"] = relative_path(folder, cfg.output_dir)
    return folders


def write_card(cfg: DuoConfig, folder: Path, method: str, fraction: str, full_heads: list[list[int]]) -> None:
    layers = [i for i, heads in enumerate(full_heads) if heads]
    how = {"gates": "DuoAttention's trained gates", "needle": "the attention mass on needles (training-free)",
           "needle_passkey": "the larger of the attention masses on needles and on filler passkeys (training-free)",
           "swap_kl": "the per-head swap KL (training-free)"}[method]
    data = ModelCardData(base_model=hub_id(cfg.model), library_name="transformers", pipeline_tag="text-generation",
                         tags=["attention-zoo", "duo", "duoattention"])
    body = (f"# {folder.name}: {cfg.model} with DuoAttention heads\n\n{count_heads(full_heads)} KV heads keep the "
            f"whole cache (layers {layers}), chosen by {how} as the top {float(fraction):.0%} across the model; the "
            f"others keep {cfg.sinks} sinks + {cfg.recent} recent tokens. Made with attention-zoo's "
            "`recipes/duo.py` (docs/recipes/choosing-heads.md); `heads.json` in the run folder holds the scores.\n\n"
            "```python\nimport zoo, transformers\nmodel = transformers.AutoModelForCausalLM.from_pretrained(FOLDER)\n"
            f"```\n\nfull_heads = {full_heads}\n")
    ModelCard(f"---\n{data.to_yaml()}\n---\n{body}").save(folder / "README.md")


def run(cfg: DuoConfig) -> dict:
    """Scores, chosen heads, ``heads.json``, ``heads_map.png`` and the model folders in ``cfg.output_dir``."""
    started = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(cfg.seed)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    log_path = cfg.output_dir / "gates_log.jsonl"
    log_path.unlink(missing_ok=True)
    scores, record = scores_of(cfg, model, tokenizer, lambda row: (append_jsonl(log_path, row), logger.info(
        "gates: step %d distill %.4g L1 %.2f mean alpha %.3f (%.1f s)", row["step"], row["distill"], row["l1"],
        row["mean_alpha"], row["seconds"])))
    # the validation book (the retrofit's held-out text): swap KL and each layout's KL from the original
    sequences = book_sequences(tokenizer, "validation", cfg.held_out["length"], cfg.held_out["sequences"])
    teacher = next_token_logprobs(model, sequences)
    if cfg.swap_kl:
        tick = time.perf_counter()
        scores["swap_kl"] = swap_kl(model, sequences, teacher, cfg.sinks, cfg.recent, divergence)
        record["swap_kl"] = {"sequences": len(sequences), "minutes": (time.perf_counter() - tick) / 60}
    chosen = {method: {str(f): choose_full_heads(table, f) for f in cfg.fractions} for method, table in scores.items()}
    held = {"sequences": len(sequences), "length": int(sequences.shape[1]), "book": "validation",
            "original_perplexity": divergence(model, sequences, teacher)["perplexity"],
            "layouts": layout_kl(cfg, model, sequences, teacher, chosen)}
    plot_heads_map(scores, chosen, cfg.output_dir / "heads_map.png",
                   f"{cfg.model}: KV-head scores ({cfg.sinks} sinks + {cfg.recent} recent for streaming heads)")
    summary = {
        "model": cfg.model, "sinks": cfg.sinks, "recent": cfg.recent, "fractions": cfg.fractions,
        "data": {**cfg.data, "haystack": "Gutenberg LM train books (passkey_prompts: the passkey filler)",
                 "seeds": {"train": cfg.seed, "calibration": cfg.seed + 1, "passkey": cfg.seed + 2}},
        "scores": {method: table.tolist() for method, table in scores.items()},
        "chosen": chosen,
        "heads": {m: {f: count_heads(h) for f, h in layouts.items()} for m, layouts in chosen.items()},
        "held_out_kl": held, **record, "threads": torch.get_num_threads(),
    }
    summary["folders"] = save_layouts(cfg, model, tokenizer, chosen)
    summary["minutes"] = (time.perf_counter() - started) / 60
    (cfg.output_dir / "heads.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duo", description="Choose DuoAttention's full KV heads two ways.")
    parser.add_argument("config", help="recipes/configs/duo/smollm2_cpu.yaml or one like it")
    parser.add_argument("--output_dir", "--output-dir", default=None, help="override the config's output_dir")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    summary = run(load_config(args.config, {"output_dir": args.output_dir}))
    for method, layouts in summary["chosen"].items():
        for fraction, full_heads in layouts.items():
            kl = summary["held_out_kl"]["layouts"][f"{method} {fraction}"]["kl"]
            print(f"{method} {fraction}: {count_heads(full_heads)} heads, held-out KL {kl:.4f}, layers "
                  f"{[i for i, h in enumerate(full_heads) if h]}")
