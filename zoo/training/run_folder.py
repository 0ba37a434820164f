"""One run per output folder, resumes that are exact or refused, checkpoints that are complete or not picked.

* :func:`lock_output_dir` -- the main process locks the folder (:class:`zoo.training.run_lock.RunLock`); with
  ``overwrite_output_dir`` the previous run's files are removed first, so two runs' files never mix.
* :func:`resume_plan` -- which checkpoint a resume starts from: a named checkpoint must be complete (model,
  optimizer, scheduler, RNG and trainer state; transformers' Trainer would silently start a fresh optimizer
  without ``optimizer.pt``) unless only its weights are asked for; ``resume_from_checkpoint: true`` takes the
  newest complete one and says which it skipped; a run already at ``max_steps`` is not trained again; a checkpoint
  of another variant, variant parameters or model is refused.
* :class:`Trainer` -- a failed checkpoint write (disk full, permissions) removes the partial folder, so it can never
  be resumed, and names the folder and the free space.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from zoo.plug.spec import CONFIG_KEY
from zoo.training import distributed
from zoo.training.config import FinetuneConfig, resolve, resolve_pretrained
from zoo.training.run_lock import RunLock
from zoo.variant import Variant

logger = logging.getLogger("zoo.training.finetune")
# What a checkpoint needs for an exact resume, besides one RNG file per process: each entry is satisfied by any of its
# non-empty files or folders (the first is named when none is there). Under FSDP, transformers' Trainer writes the
# optimizer as optimizer.bin (full state dict) or an optimizer_0 folder (sharded), and adds pytorch_model_fsdp*.
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model_fsdp.bin",
           "pytorch_model_fsdp_0")  # fmt: skip
STATE = (("optimizer.pt", "optimizer.bin", "optimizer_0"), ("scheduler.pt",), ("trainer_state.json",))
# Files a previous run wrote that the next one would append to or leave beside its own (--overwrite_output_dir).
RUN_FILES = (
    "results.json", "train_log.jsonl", "eval_predictions.csv", "sample.json", "sample.txt", "trainer_state.json",
)  # fmt: skip


def lock_output_dir(cfg: FinetuneConfig) -> RunLock:
    """The main process locks output_dir (the others hold an unheld lock); then, with ``overwrite_output_dir``
    and no resume, the previous run's files are cleared so that the two runs' files never mix."""
    lock = RunLock(cfg.output_dir)
    if not distributed.is_main_process():
        return lock
    lock.acquire()
    if cfg.overwrite_output_dir and not cfg.resume_from_checkpoint:
        clear_previous_run(Path(cfg.output_dir))
    return lock


def clear_previous_run(out: Path) -> None:
    old = [out / name for name in RUN_FILES if (out / name).exists()] + sorted(out.glob(f"{PREFIX_CHECKPOINT_DIR}-*"))
    if old:
        logger.warning("overwrite_output_dir: removing the previous run's %s", ", ".join(p.name for p in old))
    for path in old:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


# ---------------------------------------------------------------------------------------------------
# resume


def missing_files(checkpoint: Path, weights_only: bool = False) -> list[str]:
    """What an exact resume needs and this checkpoint lacks: missing or empty files, an unreadable trainer state or
    RNG file (an interrupted write). Empty: the checkpoint is complete."""
    problems = [] if _present(checkpoint, WEIGHTS) else [f"{WEIGHTS[0]} (missing or empty)"]
    if weights_only:
        return problems
    for names in STATE:
        if not _present(checkpoint, names):
            problems.append(f"{names[0]} ({'empty' if (checkpoint / names[0]).exists() else 'missing'})")
        elif names[0].endswith(".json") and not _parses_as_json(checkpoint / names[0]):
            problems.append(f"{names[0]} (cut short)")
    rng_files = sorted(checkpoint.glob("rng_state*.pth"))
    if not rng_files:
        problems.append("rng_state.pth (missing)")
    for path in rng_files:
        try:
            torch.load(path, weights_only=False)
        except Exception:  # noqa: BLE001 -- any unreadable RNG file makes the checkpoint incomplete
            problems.append(f"{path.name} (unreadable)")
    return problems


def _present(checkpoint: Path, names: tuple[str, ...]) -> bool:
    """Any of these names is a non-empty file or a non-empty folder in the checkpoint."""
    paths = [checkpoint / name for name in names]
    return any(p.stat().st_size if p.is_file() else p.is_dir() and any(p.iterdir()) for p in paths)


def _parses_as_json(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except ValueError:
        return False
    return True


def checkpoints_newest_first(out: Path) -> list[Path]:
    found = [p for p in out.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]), reverse=True)


@dataclass
class ResumePlan:
    checkpoint: str | None = None  # what Trainer.train resumes from (None: a fresh start)
    weights: str | None = None  # resume_weights_only: the folder the model weights come from
    finished_at: int | None = None  # the run already reached max_steps at this step: nothing to train


def resume_plan(cfg: FinetuneConfig, variant: Variant | None = None) -> ResumePlan:
    """The checkpoint this run starts from, checked: complete (or weights only, if asked), the same variant and
    model, not already finished. Every process computes the same plan from the same files. ``variant``: the run's,
    resolved once (:func:`~zoo.training.config.resolve`), else built here."""
    if not cfg.resume_from_checkpoint:
        return ResumePlan()
    out = Path(cfg.output_dir)
    if cfg.resume_from_checkpoint is True:
        checkpoint = newest_complete_checkpoint(out, cfg.resume_weights_only)
    else:
        checkpoint = Path(cfg.resume_from_checkpoint)
        problems = missing_files(checkpoint, cfg.resume_weights_only)
        if problems:
            raise FileNotFoundError(
                f"checkpoint {checkpoint} cannot be resumed exactly: {', '.join(problems)}. Resume another checkpoint, "
                "or set resume_weights_only: true to start from its weights with a fresh optimizer and schedule."
            )
    check_same_run(cfg, checkpoint, variant)
    if cfg.resume_weights_only:
        return ResumePlan(weights=str(checkpoint))
    step, max_steps = finished_step(cfg, checkpoint)
    if step is not None:
        logger.warning(
            "checkpoint %s is at step %d of max_steps %d: the run is finished, nothing to train (results.json left "
            "as is). Raise --max_steps to train further.", checkpoint, step, max_steps,
        )  # fmt: skip
        return ResumePlan(checkpoint=str(checkpoint), finished_at=step)
    return ResumePlan(checkpoint=str(checkpoint))


def newest_complete_checkpoint(out: Path, weights_only: bool = False) -> Path:
    candidates = checkpoints_newest_first(out)
    if not candidates:
        raise FileNotFoundError(f"resume_from_checkpoint: true, but {out} holds no checkpoint-* folder.")
    skipped = []
    for checkpoint in candidates:
        problems = missing_files(checkpoint, weights_only)
        if not problems:
            for name, why in skipped:
                logger.warning("resume: skipped the incomplete %s (%s); resuming %s", name, why, checkpoint.name)
            return checkpoint
        skipped.append((checkpoint.name, ", ".join(problems)))
    raise FileNotFoundError(
        f"resume_from_checkpoint: true, but no checkpoint in {out} is complete: "
        + "; ".join(f"{name}: {why}" for name, why in skipped)
    )


def finished_step(cfg: FinetuneConfig, checkpoint: Path) -> tuple[int | None, int]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    max_steps = cfg.max_steps if cfg.max_steps > 0 else int(state.get("max_steps") or 0)
    step = int(state.get("global_step") or 0)
    return (step if max_steps and step >= max_steps else None), max_steps


def check_same_run(cfg: FinetuneConfig, checkpoint: Path, variant: Variant | None = None) -> None:
    """Refuse a checkpoint of another variant, variant parameters or model (results.json would then credit the
    whole run to this config)."""
    saved = json.loads((checkpoint / "config.json").read_text()) if (checkpoint / "config.json").is_file() else {}
    spec = saved.get(CONFIG_KEY) or {}
    ours = {"variant": cfg.variant, "params": dict((variant or resolve(cfg).variant).config)}
    theirs = {"variant": spec.get("variant", "(none)"), "params": spec.get("params", {})}
    if json.loads(json.dumps(ours)) != json.loads(json.dumps(theirs)):
        raise ValueError(
            f"checkpoint {checkpoint} was trained with variant {theirs['variant']!r} {theirs['params']}, this run "
            f"asks for {ours['variant']!r} {ours['params']}. Resume with the checkpoint's variant, or start a new "
            "run in another output_dir."
        )
    expected = dict(cfg.model_config or {})
    if cfg.model_name_or_path is not None:
        expected = {"model_type": pretrained_model_type(cfg.model_name_or_path)}
    differ = {k: (saved.get(k), v) for k, v in expected.items() if saved.get(k) != v}
    if differ:
        detail = ", ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in differ.items())
        raise ValueError(f"checkpoint {checkpoint} holds another model ({detail}); resume it with its own model.")


def pretrained_model_type(name: str) -> str | None:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_pretrained(name)[0]).model_type


# ---------------------------------------------------------------------------------------------------
# checkpoint writes


def checkpoint_write_failed(folder: Path, exc: BaseException, should_save: bool) -> None:
    """A checkpoint write into ``folder`` raised ``exc``: re-raise what is not a write failure; else remove the
    partial folder (on the saving process) and raise an OSError naming the folder and the free space."""
    if not is_write_failure(exc):
        raise exc
    if should_save:
        shutil.rmtree(folder, ignore_errors=True)  # never resumable: resume_from_checkpoint skips nothing half
    free = shutil.disk_usage(folder.parent).free / 2**20
    message = (
        f"writing checkpoint {folder} failed ({type(exc).__name__}: {exc}); {free:.0f} MB free on "
        f"{folder.parent}. The partial checkpoint was removed; free space (the model with its optimizer "
        "state takes about 3x the weights) and resume from the previous checkpoint."
    )
    disk_full = "space" in str(exc).lower() or getattr(exc, "errno", None) == errno.ENOSPC
    raise (OSError(errno.ENOSPC, message) if disk_full else OSError(message)) from exc


def is_write_failure(exc: BaseException) -> bool:
    """An OSError, or torch's RuntimeError from its zip writer (``inline_container.cc ... unexpected pos``)."""
    return isinstance(exc, OSError) or "inline_container" in str(exc) or "unexpected pos" in str(exc)
