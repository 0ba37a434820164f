"""The plan of a comparison (:mod:`zoo.training.compare`): the compare config checked, every (task, variant entry)
merged into its fine-tune config with its seeds and learning-rate grid (:class:`Entry`), and the runs known before any
has run (:class:`Run`); :class:`Outcome` is what a run ended with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zoo.data import get_task
from zoo.training.config import FinetuneConfig, check_known_keys, load_yaml
from zoo.training.numerics import pinned_env

COMPARE_KEYS = ("output_dir", "launcher", "seeds", "timeout_minutes", "overrides", "learning_rates", "variants",
                "tasks", "cpu_isa")
TASK_KEYS = ("name", "config", "overrides", "variants", "seeds")

@dataclass
class Run:
    task: str
    name: str
    seed: int
    config: dict
    run_dir: Path
    kind: str = "classification"  # the task's kind, a key of zoo.training.kinds.KINDS
    learning_rates: tuple[float, ...] | None = None  # the entry's sweep grid (None: no sweep, the task's rate)


@dataclass
class Entry:
    """One (task, variant entry): its merged fine-tune config (no seed, no output_dir), seeds and sweep grid."""

    task: str
    name: str
    config: dict
    seeds: list[int]
    kind: str
    folder: Path  # output_dir/runs/TASK/NAME
    learning_rates: tuple[float, ...] | None = None

    def run(self, seed: int, rate: float | None = None) -> Run:
        """The run of one seed (at one rate of the sweep: its own folder, NAME/lr0.003/seed0)."""
        folder = self.folder if rate is None else self.folder / f"lr{rate:g}"
        run_dir = folder / f"seed{seed}"
        config = {**self.config, "seed": seed, "output_dir": str(run_dir), "overwrite_output_dir": True}
        if rate is not None:
            config["learning_rate"] = rate
        return Run(self.task, self.name, seed, config, run_dir, self.kind, self.learning_rates)

    def first_runs(self) -> list[Run]:
        """What runs before any result is known: every seed, or (a sweep) every rate on the first seed."""
        if self.learning_rates is None:
            return [self.run(seed) for seed in self.seeds]
        return [self.run(self.seeds[0], rate) for rate in self.learning_rates]


@dataclass
class Outcome:
    status: str  # ok | failed | timeout | unavailable
    error: str = ""
    results: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------
# plan


def load_compare_config(path: str) -> dict:
    cfg = load_yaml(path)
    unknown = sorted(set(cfg) - set(COMPARE_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; compare configs take {', '.join(COMPARE_KEYS)}.")
    if not cfg.get("tasks"):
        raise ValueError(f"{path}: list at least one task under `tasks:` (name + config).")
    cfg.setdefault("seeds", [42])
    cfg.setdefault("launcher", None)
    cfg.setdefault("timeout_minutes", 60)
    cfg.setdefault("cpu_isa", None)
    pinned_env(cfg["cpu_isa"])  # an unknown value fails here, before any run
    if cfg["launcher"] and not Path(cfg["launcher"]).is_file():
        raise FileNotFoundError(f"launcher {cfg['launcher']!r} (an accelerate config file) does not exist.")
    return cfg


def variant_label(entry: dict) -> str:
    return entry.get("name") or entry.get("variant", "sdpa")


def sweep_grid(value: Any, source: str) -> tuple[float, ...] | None:
    """A ``learning_rates`` value checked: None, or at least two distinct positive numbers."""
    if value is None:
        return None
    numbers = isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    if not numbers or len(set(value)) < 2 or len(set(value)) != len(value) or min(value) <= 0:
        raise ValueError(f"{source}: learning_rates must be a list of at least two distinct positive rates, e.g. "
                         f"[1.0e-3, 3.0e-3, 1.0e-2], or null (the task's rate); got {value!r}.")
    return tuple(float(v) for v in value)


def plan_entries(cfg: dict, output_dir: Path) -> list[Entry]:
    """Every (task, variant entry) with its full fine-tune config and sweep grid, checked before anything starts."""
    entries_out = []
    default_grid = sweep_grid(cfg.get("learning_rates"), "compare config")
    for task in cfg["tasks"]:
        unknown = sorted(set(task) - set(TASK_KEYS))
        if unknown or "name" not in task or "config" not in task:
            raise ValueError(
                f"task entry {task!r}: needs `name` and `config`; optional keys: overrides, variants, seeds."
            )
        base = load_yaml(task["config"])
        entries = list(cfg.get("variants") or []) + list(task.get("variants") or [])
        labels = [variant_label(e) for e in entries]
        if len(set(labels)) != len(labels):
            raise ValueError(f"task {task['name']!r}: two variant entries share a name; give each a distinct `name`.")
        for entry in entries:
            source = f"task {task['name']!r}, variant {variant_label(entry)!r}"
            overrides = {k: v for k, v in entry.items() if k not in ("name", "learning_rates")}
            merged = {**base, **(cfg.get("overrides") or {}), **(task.get("overrides") or {}), **overrides}
            check_known_keys(merged, FinetuneConfig, source)
            grid = sweep_grid(entry["learning_rates"], source) if "learning_rates" in entry else default_grid
            if grid is not None and "learning_rate" in entry:
                raise ValueError(f"{source}: sets learning_rate and is swept over learning_rates; keep one (an "
                                 "entry with its own rate takes learning_rates: null).")
            if grid is not None:
                merged["evaluate_validation"] = True  # the rate is chosen on the validation split
            seeds = list(task.get("seeds") or cfg["seeds"])  # a task may set its own seeds
            folder = output_dir / "runs" / task["name"] / variant_label(entry)
            kind = get_task(merged.get("task", "")).kind
            entries_out.append(Entry(task["name"], variant_label(entry), merged, seeds, kind, folder, grid))
    return entries_out


def plan_runs(cfg: dict, output_dir: Path) -> list[Run]:
    """The runs known before any has run: every seed of each entry; a sweep's rates on its first seed (the other
    seeds run at the rate its results choose, :func:`choose_rate`)."""
    return [run for entry in plan_entries(cfg, output_dir) for run in entry.first_runs()]
