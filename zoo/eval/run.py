"""One ``zoo eval`` run: write the prompts, answer them with every contestant, measure perplexity by position and
speed, hand the prompts to the kvpress peer, write the report. Every measurement is appended to a JSON-lines file of
the run folder as it finishes; with ``resume`` a finished contestant x task x length is not run again.

Files of a run folder: ``config.yaml`` (as run), ``prompts.jsonl`` (every sample, token ids included: a peer answers
exactly these), ``answers.jsonl``, ``perplexity.jsonl``, ``speed.jsonl``, ``kvpress.jsonl`` (the peer's), and the
report (``results.md``, ``results.csv``, ``results.json``, plots).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer

from zoo.eval import ruler
from zoo.eval.answer import answer_cell
from zoo.eval.config import EvalConfig, EvalConfigError
from zoo.eval.contestants import load_model, model_path
from zoo.eval.perplexity import perplexity_row
from zoo.eval.report import write_eval_report
from zoo.eval.rows import row_fields
from zoo.eval.speed import measure_in_process
from zoo.eval.tasks import Sample, make_samples
from zoo.reporting import append_jsonl, read_jsonl

PEER = Path(__file__).resolve().parents[2] / "scripts" / "kvpress_peer.py"


def positions(model: str) -> int | None:
    """The most positions the model's config allows (None when it names no limit)."""
    settings = AutoConfig.from_pretrained(model_path(model))
    settings = getattr(settings, "text_config", None) or settings
    return next((value for name in ("max_position_embeddings", "n_positions", "n_ctx")
                 if isinstance(value := getattr(settings, name, None), int)), None)


def check_lengths(config: EvalConfig) -> None:
    """Refuse lengths beyond the model's positions before any model is loaded."""
    most, longest = positions(config.model), max((n for spec in config.tasks for n in spec.lengths), default=0)
    if most is not None and longest > most:
        raise EvalConfigError(f"{config.model}: the length {longest} is beyond the model's {most} positions "
                              f"(its config.json); use lengths up to {most}.")


def check_prompts(config: EvalConfig, samples: list[Sample]) -> None:
    """Refuse a prompt whose answer budget runs past the model's positions (a chat template adds tokens)."""
    most = positions(config.model)
    over = [s for s in samples if most is not None and len(s.ids) + s.new_tokens > most]
    if over:
        first = over[0]
        raise EvalConfigError(f"{first.task} @ {first.length}: a prompt of {len(first.ids)} tokens and an answer "
                              f"budget of {first.new_tokens} run past the model's {most} positions ({len(over)} "
                              "samples); use a shorter length or chat_template: false.")


def build_samples(config: EvalConfig, tokenizer) -> list[Sample]:
    """Every sample of the run, in task and length order (deterministic in the config's seed)."""
    samples = []
    for spec in config.tasks:
        if spec.source == "ruler":
            samples += map(Sample.from_json, ruler.build(tokenizer, model_path(config.model), spec.task,
                                                         spec.lengths, spec.samples, seed=config.seed,
                                                         label=spec.label, **spec.options))
            continue
        for length in spec.lengths:
            made = make_samples(tokenizer, spec.task, length, spec.samples[length], seed=config.seed,
                                label=spec.label, depths=config.depths, **spec.options)
            for sample in made if spec.scoring != "strict" else ():  # strict: the default, not written
                sample.meta["scoring"] = spec.scoring
            samples += made
    check_prompts(config, samples)
    return samples


def write_prompts(out: Path, samples: list[Sample], resume: bool) -> None:
    """``prompts.jsonl``. A resumed run may add or drop tasks and lengths (every sample has its own seed), but a
    sample it shares with the run it continues must be the same: the answers there belong to it."""
    path = out / "prompts.jsonl"
    if path.exists() and resume:
        old = {(s.task, s.length, s.index): s.to_json() for s in map(Sample.from_json, read_jsonl(path))}
        changed = sorted(f"{task} @ {length} #{index}" for (task, length, index), row in old.items()
                         if (new := next((s for s in samples if (s.task, s.length, s.index) == (task, length, index)),
                                         None)) is not None and new.to_json() != row)
        if changed:
            raise SystemExit(f"zoo eval: {path} holds other prompts than this config makes for {changed[:3]} "
                             f"({len(changed)} samples; the seed, a task's options or a sample count changed): the "
                             "answers there belong to those. Use another output_dir, or --overwrite to start again.")
    path.write_text("".join(json.dumps(s.to_json()) + "\n" for s in samples))


def cells(samples: list[Sample]) -> list[list[Sample]]:
    """Samples grouped by (task, length), in order of first appearance."""
    groups: dict[tuple[str, int], list[Sample]] = {}
    for sample in samples:
        groups.setdefault((sample.task, sample.length), []).append(sample)
    return list(groups.values())


def record(path: Path, row: dict, contestant: dict) -> None:
    """Append a measurement of ``contestant`` with the fields the report finds it by (:mod:`zoo.eval.rows`)."""
    append_jsonl(path, {**row, **row_fields(contestant)})


def finished(rows: list[dict]) -> set[tuple[str, str, int]]:
    return {(r["contestant"], r["task"], r["length"]) for r in rows if "error" not in r}


class Models:
    """The run's model and, for ``folder`` contestants, their own models (one held at a time)."""

    def __init__(self, config: EvalConfig):
        self.name, self.device, self.dtype = config.model, config.device, config.dtype
        self.base, self.other = None, (None, None)

    def __call__(self, contestant: dict) -> tuple[Any, Any]:
        if contestant["family"] == "folder":
            if self.other[0] != contestant["path"]:
                self.other = (None, None)
                self.other = (contestant["path"], load_model(contestant["path"], self.device, self.dtype))
            return self.other[1]
        if self.base is None:
            self.base = load_model(self.name, self.device, self.dtype)
        return self.base


def run_answers(config: EvalConfig, samples: list[Sample], models: Models,
                peer: subprocess.Popen | None = None) -> None:
    """Every pending contestant x task x length; while ``peer`` (the kvpress peer) runs beside, on
    ``config.threads`` cores, then on the peer's cores too."""
    path = config.output_dir / "answers.jsonl"
    done = finished(read_jsonl(path))
    todo = [(cell, [c for c in config.contestants if (c["name"], cell[0].task, cell[0].length) not in done
                    and cell[0].length in c.get("lengths", [cell[0].length])]) for cell in cells(samples)]
    todo = [(cell, pending) for cell, pending in todo if pending]
    by_name = {c["name"]: c for c in config.contestants}
    bar = tqdm(todo, desc="zoo eval: answers", unit="cell")
    for cell, pending in bar:
        if peer is not None and peer.poll() is not None:  # the peer is done: its cores are free
            torch.set_num_threads(config.threads + int((config.kvpress or {}).get("threads", config.threads)))
            peer = None
        bar.set_postfix_str(f"{cell[0].task} {cell[0].length}: {len(pending)} contestants")

        def write(row: dict) -> None:
            record(path, row, by_name[row["contestant"]])
            shown = {k: row.get(k) for k in ("contestant", "task", "length", "score", "n", "error") if k in row}
            bar.write(json.dumps(shown))

        answer_cell(models, cell, pending, config.batch, write)


def ppl_contestants(config: EvalConfig) -> list[dict]:
    names = (config.perplexity or {}).get("contestants")
    chosen = [c for c in config.contestants if names is None or c["name"] in names]
    unknown = sorted(set(names or []) - {c["name"] for c in config.contestants})
    if unknown:
        raise SystemExit(f"zoo eval: perplexity.contestants names {unknown}, which are not contestants of the run.")
    return chosen


def run_perplexity(config: EvalConfig, models: Models) -> None:
    settings = config.perplexity
    if not settings:
        return
    path = config.output_dir / "perplexity.jsonl"
    done = finished(read_jsonl(path))
    for length in settings.get("lengths", config.lengths):
        for contestant in tqdm(ppl_contestants(config), desc=f"zoo eval: perplexity {length}", unit="contestant"):
            if (contestant["name"], "perplexity", length) in done:
                continue
            model, tokenizer = models(contestant)
            try:
                row = perplexity_row(model, tokenizer, contestant, length, settings.get("documents", 2),
                                     settings.get("bucket", 1024), settings.get("chunk", 512))
            except Exception as exc:  # recorded, the run goes on
                row = {"contestant": contestant["name"], "task": "perplexity", "length": length,
                       "error": f"{type(exc).__name__}: {exc}"}
            record(path, row, contestant)


def run_speed(config: EvalConfig) -> None:
    settings = config.speed
    if not settings:
        return
    path = config.output_dir / "speed.jsonl"
    done = {(r["contestant"], r["length"]) for r in read_jsonl(path) if "error" not in r}
    names = settings.get("contestants")
    for length in settings.get("lengths", config.lengths[-1:]):
        chosen = [c for c in config.contestants if names is None or c["name"] in names]
        for contestant in tqdm(chosen, desc=f"zoo eval: speed {length}", unit="contestant"):
            if (contestant["name"], length) in done:
                continue
            setting = {"model": config.model, "contestant": contestant, "length": length,
                       "new_tokens": settings.get("new_tokens", 16), "rounds": settings.get("rounds", 3),
                       "threads": settings.get("threads", config.threads), "device": config.device,
                       "dtype": config.dtype}
            record(path, measure_in_process(setting), contestant)


def peer_command(config: EvalConfig) -> list[str] | None:
    """The kvpress peer's command line for this run (``kvpress`` in the config), or None."""
    settings = config.kvpress
    if not settings:
        return None
    command = [str(Path(settings.get("python", ".venv-kvpress/bin/python"))), str(PEER), "--eval",
               str(config.output_dir), "--model", str(settings.get("model_folder") or model_path(config.model)),
               "--threads", str(settings.get("threads", config.threads)),
               "--budgets", *map(str, settings.get("budgets", [0.5, 0.25, 0.1]))]
    if settings.get("decoding_budgets"):
        command += ["--decoding_budgets", *map(str, settings["decoding_budgets"])]
    if settings.get("presses"):
        command += ["--only", *settings["presses"]]
    if config.batch:
        command += ["--batch", str(config.batch)]
    return command


def start_peer(config: EvalConfig) -> subprocess.Popen | None:
    """Start the kvpress peer when its environment exists (``scripts/kvpress_env.sh``), else say how to; with
    ``kvpress.parallel`` the caller answers its own contestants meanwhile (each side on ``threads`` cores)."""
    command = peer_command(config)
    if command is None:
        return None
    if not Path(command[0]).exists():
        print(f"zoo eval: kvpress peer skipped ({command[0]} is missing: run scripts/kvpress_env.sh, then "
              f"{shlex.join(command)})", flush=True)
        return None
    log = (config.output_dir / "kvpress.log").open("a")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def run(config: EvalConfig, *, resume: bool = True, dry_run: bool = False, stages: tuple[str, ...] = ()) -> Path:
    """Run every stage (``answers``, ``perplexity``, ``speed``, ``kvpress``, ``report``; ``stages`` picks some)."""
    check_lengths(config)
    out = config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(config.threads)
    models = Models(config)
    if dry_run:
        model, tokenizer = None, AutoTokenizer.from_pretrained(model_path(config.model))
    else:
        model, tokenizer = models({"family": "full"})
    samples = build_samples(config, tokenizer)
    if dry_run:
        print(describe_plan(config, samples))
        return out
    (out / "config.yaml").write_text(yaml.safe_dump(config.source, sort_keys=False))
    write_prompts(out, samples, resume)
    wanted = stages or ("answers", "perplexity", "speed", "kvpress", "report")
    parallel = bool((config.kvpress or {}).get("parallel"))
    peer = start_peer(config) if "kvpress" in wanted and parallel else None
    if "answers" in wanted:
        run_answers(config, samples, models, peer)
    if "perplexity" in wanted:
        run_perplexity(config, models)
    if "kvpress" in wanted and not parallel:
        peer = start_peer(config)
    if peer is not None and peer.wait() != 0:
        print(f"zoo eval: the kvpress peer exited with {peer.returncode}; see {config.output_dir / 'kvpress.log'}")
    if "speed" in wanted:  # last, alone on the machine
        del model
        models.base = None
        run_speed(config)
    if "report" in wanted:
        write_eval_report(out)
    return out


def describe_plan(config: EvalConfig, samples: list[Sample]) -> str:
    """What the run would do (``--dry_run``): cells, samples, prompt tokens, contestants."""
    lines = [f"zoo eval plan: {config.output_dir}", f"model: {config.model}", "tasks x lengths (samples):"]
    for cell in cells(samples):
        lines.append(f"  {cell[0].task} @ {cell[0].length}: {len(cell)} samples, {cell[0].new_tokens} new tokens")
    lines.append(f"prompt tokens: {sum(len(s.ids) for s in samples):,}")
    lines.append(f"contestants ({len(config.contestants)}):")
    lines += [f"  {c['name']} [{c['family']}]" for c in config.contestants]
    if config.perplexity:
        lines.append(f"perplexity: {config.perplexity}")
    if config.speed:
        lines.append(f"speed: {config.speed}")
    command = peer_command(config)
    if command:
        lines.append(f"kvpress peer: {shlex.join(command)}")
    return "\n".join(lines)
