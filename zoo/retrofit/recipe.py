"""``recipes/retrofit.py CONFIG``: stage 1 (capture, attention transfer of every candidate layer, the swap KL of each)
-> one model per layout (:mod:`zoo.retrofit.selection`) -> stage 2 per layout (the fine-tune recipe, with distillation
from the original model, under ``accelerate launch`` when ``stage2.processes > 1``) -> ``zoo eval`` of the original
beside every retrofitted model -> a Hub-ready folder per layout (``model.safetensors``, tokenizer, ``retrofit.json`` and
a card; ``zoo push FOLDER --repo_id ...``).

Stage 1 resumes: a finished stage 1 whose settings match is read back (``stage1/transfer_map.json`` and
``stage1/transferred.safetensors``), so new layouts cost no new transfer. Layout folders that hold a model are kept.

The records (``retrofit.json``, each layout's ``stage2.yaml`` and ``retrofit.json``) name paths relative to the run
folder (``output_dir``), so a run folder can move; stage 2's teacher is named as the config names its model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from zoo.data.gutenberg import build_lm
from zoo.data.lm import spread_windows
from zoo.eval.contestants import load_model, model_path
from zoo.plug.install import configure
from zoo.plug.weights import attention_modules
from zoo.reporting import REPOSITORY, max_rss_bytes, relative_path
from zoo.retrofit import report
from zoo.retrofit.capture import capture
from zoo.retrofit.config import STAGE2_OWN, RetrofitConfig
from zoo.retrofit.selection import (
    apply_layout,
    attention_states,
    configure_keeping_weights,
    divergence,
    hybrid_layers,
    kept_layers,
    next_token_logprobs,
    swap_kl,
    without_attention_dropout,
)
from zoo.retrofit.transfer import OwnStage, train_layer

logger = logging.getLogger("zoo.retrofit")
STAGE2_HEADER = ("# Stage 2 of a retrofit, as the fine-tune recipe's config: paths relative to the run folder, the\n"
                 "# teacher as the retrofit config names its model; the retrofit passes --output_dir,\n"
                 "# --model_name_or_path and --distill_from resolved on the command line.\n")
DEFAULT_STAGE2 = {"task": "gutenberg_lm", "max_length": 2048, "max_steps": 40, "learning_rate": 1e-4,
                  "per_device_train_batch_size": 1, "save_strategy": "no", "logging_steps": 5,
                  "generate_new_tokens": 0, "distill_weight": 0.5, "trainable": "attention"}


def recorded(cfg: RetrofitConfig, path: str | Path) -> str:
    """``path`` as the run's records name it: relative to the run folder (:func:`zoo.reporting.relative_path`)."""
    return relative_path(path, cfg.output_dir)


def book_sequences(tokenizer, split: str, length: int, count: int) -> torch.Tensor:
    """``count`` windows of ``length`` tokens from the Gutenberg LM split's books (train: transfer; validation:
    held-out errors and KL; the test books stay for ``zoo eval``'s perplexity)."""
    texts = build_lm()[split]["text"]
    books = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    windows = spread_windows(books, length, count, f"a Gutenberg {split} book", "lower data.*_sequences")
    return torch.tensor(windows)


def fingerprint(cfg: RetrofitConfig) -> str:
    """What stage 1's result depends on: the model, the variant, the layers, the data and the transfer settings."""
    transfer = asdict(cfg.transfer)
    if transfer["loss"] == "output":  # the default: stage-1 folders from before transfer.loss existed read back
        del transfer["loss"]
    keys = {"model": cfg.model, "variant": cfg.entry, "layers": cfg.layers, "data": cfg.data, "transfer": transfer}
    if cfg.stage is not None:
        keys["stage"] = cfg.stage_entry
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stage1(cfg: RetrofitConfig, model, tokenizer) -> tuple[dict, dict, dict]:
    """``(transfer map, transferred states, original states)``; the model is left as the original (zoo sdpa)."""
    folder = cfg.output_dir / "stage1"
    map_path, states_path = folder / "transfer_map.json", folder / "transferred.safetensors"
    without_attention_dropout(model)
    configure(model, "sdpa")  # the original attention, through the zoo: the kwargs captured suit every layer
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    original = attention_states(model)
    layers = sorted(cfg.layers if cfg.layers is not None else original)
    length = cfg.data_setting("sequence_length")
    held_out = book_sequences(tokenizer, "validation", length, cfg.data_setting("held_out_sequences"))
    if map_path.is_file() and states_path.is_file():
        done = json.loads(map_path.read_text())
        if done.get("fingerprint") == fingerprint(cfg):
            logger.info("retrofit: stage 1 read back from %s", folder)
            return done, unflatten(load_file(states_path)), original
    started = time.perf_counter()
    train = book_sequences(tokenizer, "train", length, cfg.data_setting("train_sequences"))
    with tempfile.TemporaryDirectory(dir=cfg.output_dir, prefix="_activations") as scratch:
        captured = capture(model, torch.cat([train, held_out]), Path(scratch), layers)
        capture_seconds = time.perf_counter() - started
        configure(model, "hybrid", layers=hybrid_layers(len(original), layers, cfg.entry))
        modules = {idx: module for _, idx, module in attention_modules(model)}
        train_rows = list(range(len(train)))
        held_rows = list(range(len(train), len(train) + len(held_out)))
        rows, transferred = [], {}
        stage = own_stage(cfg, model, len(original), layers)
        for layer in layers:
            modules[layer].load_state_dict(original[layer], strict=False)
            rows.append(train_layer(modules[layer], captured, layer, train_rows, held_rows, cfg.transfer, stage))
            transferred[layer] = {k: v.detach().clone() for k, v in modules[layer].state_dict().items()}
            row = rows[-1]
            errors = f"{row['error_before']:.3f} -> {row['error_after']:.3f}"
            measure = f"; {row['measure']} {row['measure_before']:.3f} -> {row['measure_after']:.3f}" if stage else ""
            logger.info("retrofit: layer %d error %s%s (%.0f s)", layer, errors, measure, row["seconds"])
        disk = captured.disk_bytes
        captured.delete()
    transfer_seconds = time.perf_counter() - started - capture_seconds
    apply_layout(model, [], cfg.entry, transferred, original)
    teacher = next_token_logprobs(model, held_out)
    original_score = divergence(model, held_out, teacher)
    kl = swap_kl(model, layers, cfg.entry, transferred, original, held_out, teacher)
    for row in rows:
        row["swap_kl"] = kl[row["layer"]]
    done = {
        "fingerprint": fingerprint(cfg), "variant": cfg.entry, "layers": rows,
        **({"stage": cfg.stage_entry} if stage is not None else {}),
        "original_held_out_perplexity": original_score["perplexity"],
        "tokens": sum(row["tokens"] for row in rows), "sequence_length": length,
        "train_tokens": int(train.numel()), "held_out_tokens": int(held_out.numel()),
        "seconds": {"capture": capture_seconds, "transfer": transfer_seconds,
                    "swap_kl": time.perf_counter() - started - capture_seconds - transfer_seconds},
        "activations_disk_bytes": disk, "peak_rss_mb": max_rss_bytes() / 2**20, "threads": torch.get_num_threads(),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(flatten(transferred), states_path)
    map_path.write_text(json.dumps(done, indent=2) + "\n")
    report.write_transfer_map(done, folder)
    return done, transferred, original


def own_stage(cfg: RetrofitConfig, model, count: int, layers: list[int]) -> OwnStage | None:
    """The variant's own stage 1 (DSA's dense warm-up), switching the converted layers' parameters; or None."""
    stage = cfg.stage
    if stage is None:
        return None
    entries = {True: hybrid_layers(count, layers, cfg.stage_entry), False: hybrid_layers(count, layers, cfg.entry)}
    return OwnStage(stage.measure, lambda on: configure_keeping_weights(model, entries[on]))


def flatten(states: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{layer}/{key}": tensor.contiguous() for layer, state in states.items() for key, tensor in state.items()}


def unflatten(tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    states: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        layer, key = name.split("/", 1)
        states.setdefault(int(layer), {})[key] = tensor
    return states


def build_layout(cfg: RetrofitConfig, layout: dict, model, tokenizer, stage: dict, held_out: torch.Tensor,
                 teacher: torch.Tensor) -> dict:
    """Apply one layout, measure it on the held-out text (``teacher``: the original's log-probs), save it (its
    stage-1 folder); returns its record. ``stage``: stage 1's transfer map and the transferred and original states."""
    done, transferred, original = stage["map"], stage["transferred"], stage["original"]
    count = len(original)
    rows = {row["layer"]: row for row in done["layers"]}
    kept = kept_layers(layout, count, {i: r["swap_kl"] for i, r in rows.items()},
                       {i: r["error_after"] for i, r in rows.items()})
    converted = [i for i in sorted(rows) if i not in kept]
    kept = [i for i in range(count) if i not in converted]  # with `layers` set, the layers never converted too
    layers = apply_layout(model, converted, cfg.entry, transferred, original)
    score = divergence(model, held_out, teacher)
    folder = cfg.output_dir / layout["name"] / "stage1"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"name": layout["name"], "layout": layout, "kept_full": kept, "converted": converted, "layers": layers,
            "stage1": {"folder": recorded(cfg, folder), "held_out_kl": score["kl"],
                       "held_out_perplexity": score["perplexity"], "tokens": done["tokens"]}}


def stage2(cfg: RetrofitConfig, record: dict) -> Path:
    """Fine-tune one layout's stage-1 model (the fine-tune recipe in a process of its own); returns its folder."""
    settings = {**DEFAULT_STAGE2, **{k: v for k, v in cfg.stage2.items() if k not in STAGE2_OWN}}
    out = cfg.output_dir / record["name"] / "stage2"
    settings.update(output_dir=recorded(cfg, out), model_name_or_path=record["stage1"]["folder"], variant="hybrid",
                    variant_params={"layers": record["layers"]}, seed=cfg.seed)
    if settings.get("distill_weight", 0) > 0:
        settings.setdefault("distill_from", cfg.model)
    path = cfg.output_dir / record["name"] / "stage2.yaml"
    if (out / "results.json").is_file() and path.is_file() and yaml.safe_load(path.read_text()) == settings:
        logger.info("retrofit: stage 2 of %s read back from %s", record["name"], out)
        return read_stage2(cfg, record, out, settings, None)
    path.write_text(STAGE2_HEADER + yaml.safe_dump(settings, sort_keys=False))
    paths = ["--output_dir", str(out), "--model_name_or_path", str(cfg.output_dir / settings["model_name_or_path"])]
    if settings.get("distill_from"):
        paths += ["--distill_from", model_path(settings["distill_from"])]
    processes = int(cfg.stage2.get("processes", 1))
    command = [sys.executable, "-m", "zoo.training.finetune", str(path), *paths]
    if processes > 1:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "-m", "zoo.training.finetune", str(path), *paths]
    if out.is_dir():
        command += ["--overwrite_output_dir", "true"]  # an unfinished or differently set stage 2: run again
    started = time.perf_counter()
    subprocess.run(command, check=True)
    return read_stage2(cfg, record, out, settings, time.perf_counter() - started)


def read_stage2(cfg: RetrofitConfig, record: dict, out: Path, settings: dict, seconds: float | None) -> Path:
    """Fill ``record["stage2"]`` from a finished fine-tune's folder (``seconds``: None when read back)."""
    results = json.loads((out / "results.json").read_text())
    state = json.loads((out / "trainer_state.json").read_text())
    record["stage2"] = {"folder": recorded(cfg, out), "seconds": results.get("wall_time_seconds", seconds),
                        "processes": results.get("num_processes"), "tokens": state.get("num_input_tokens_seen"),
                        "settings": settings, "test_perplexity": (results.get("metrics") or {}).get("eval_perplexity")}
    return out


def evaluate(cfg: RetrofitConfig, records: list[dict]) -> Path:
    """``zoo eval`` of the config's eval file with every retrofitted model added as a folder contestant."""
    source = yaml.safe_load(Path(cfg.eval["config"]).read_text())
    source["output_dir"] = str(cfg.output_dir / "eval")
    source["contestants"] = list(source["contestants"]) + [
        {"family": "folder", "path": str(cfg.output_dir / record["model_folder"]), "name": f"retrofit {record['name']}"}
        for record in records]
    for key in ("perplexity", "speed"):
        if source.get(key) and "contestants" in source[key]:
            source[key]["contestants"] = list(source[key]["contestants"]) + [f"retrofit {r['name']}" for r in records]
    path = cfg.output_dir / "eval.yaml"
    path.write_text(yaml.safe_dump(source, sort_keys=False))
    subprocess.run([sys.executable, "-m", "zoo.eval", str(path)], check=True)
    return Path(source["output_dir"])


def run(cfg: RetrofitConfig, stages: tuple[str, ...] = ("stage1", "stage2", "eval")) -> dict[str, Any]:
    """Every stage; returns the run's summary (also ``output_dir/retrofit.json``)."""
    started = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(cfg.seed)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    done, transferred, original = stage1(cfg, model, tokenizer)
    stage = {"map": done, "transferred": transferred, "original": original}
    held_out = book_sequences(tokenizer, "validation", done["sequence_length"], cfg.data_setting("held_out_sequences"))
    apply_layout(model, [], cfg.entry, transferred, original)
    teacher = next_token_logprobs(model, held_out)
    records = [build_layout(cfg, layout, model, tokenizer, stage, held_out, teacher) for layout in cfg.layouts]
    del model
    for record in records:
        folder = cfg.output_dir / record["stage1"]["folder"]
        if cfg.stage2 is not None and "stage2" in stages:
            folder = stage2(cfg, record)
            tuned = AutoModelForCausalLM.from_pretrained(folder).to(cfg.device or "cpu")
            record["stage2"].update({f"held_out_{k}": v for k, v in divergence(tuned, held_out, teacher).items()})
            del tuned
        record["model_folder"] = recorded(cfg, folder)
    config = {**cfg.source, "output_dir": relative_path(cfg.output_dir, REPOSITORY, root=cfg.output_dir)}
    summary = {"base_model": cfg.model, "variant": cfg.entry, "config": config, "stage1": done, "layouts": records}
    if cfg.eval is not None and "eval" in stages:
        summary["eval_folder"] = recorded(cfg, evaluate(cfg, records))
    summary["seconds"] = time.perf_counter() - started
    for record in records:
        report.write_model_folder(summary, record, cfg.output_dir)
    (cfg.output_dir / "retrofit.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    report.write_summary(summary, cfg.output_dir)
    return summary
