"""What ``zoo bench`` runs: its settings, the contestants chosen by name, their cost models, and which
(contestant, length) combinations to skip — estimated from the lengths measured so far, so that a run over
``--max_seconds`` or the machine's memory is noted in the table instead of crashing it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import torch

from zoo.bench.contestants import Contestant, FailedContestant, ZooContestant
from zoo.bench.peers import PEERS
from zoo.registry import ENTRY_POINT_GROUP, get_variant_class, list_variants
from zoo.reporting import describe_error, human_bytes
from zoo.variant import VariantParameterError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_LENGTHS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
FIT_FROM = 4096  # exponents are fitted over lengths >= this when two or more are present


@dataclass
class BenchSettings:
    lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    hidden: int = 768
    heads: int = 12
    batch: int = 1
    dtype: str = "fp32"
    mode: str = "fwd+bwd"
    causal: bool = False
    device: str = "cpu"
    threads: int = field(default_factory=torch.get_num_threads)
    repeats: int = 3
    warmup: int = 1
    max_seconds: float = 120.0  # estimated seconds of ONE iteration above which a combination is skipped
    error_length: int = 1024
    roof_size: int = 2048
    dropout: float = 0.0  # attention dropout; > 0 runs the measured layer in training mode

    @property
    def backward(self) -> bool:
        return self.mode == "fwd+bwd"

    @property
    def training(self) -> bool:
        """The measured layer's mode: training for a backward pass or attention dropout, else eval."""
        return self.backward or self.dropout > 0

    @property
    def passes(self) -> int:
        """FLOP multiplier of the mode: a backward pass costs about two forwards."""
        return 3 if self.backward else 1

    def check(self) -> None:
        problems = []
        if self.hidden % self.heads:
            problems.append(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        if not self.lengths or min(self.lengths) < 1:
            problems.append(f"--lengths must be positive integers, got {self.lengths}")
        if self.repeats < 1 or self.warmup < 0:
            problems.append("--repeats must be >= 1 and --warmup >= 0")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"--dropout is a probability in [0, 1), got {self.dropout:g}")
        if self.device == "cuda" and not torch.cuda.is_available():
            problems.append("--device cuda but torch sees no CUDA GPU here (use --device cpu)")
        if problems:
            raise ValueError("zoo bench: " + "; ".join(problems) + ".")


# ---------------------------------------------------------------------------------------------------
# choosing the contestants


def registered_names() -> list[str]:
    """Every variant with an entry point or in-process registration, broken ones included (they get a row)."""
    names = set(list_variants()) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    first = [n for n in ("sdpa", "dense") if n in names]
    return first + sorted(names - set(first))


def parse_variant_params(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["longformer.window=256", "bigbird.seed=3"]`` -> ``{"longformer": {"window": 256}, ...}`` (JSON values)."""
    parsed: dict[str, dict[str, Any]] = {}
    for item in items:
        name, dot, rest = item.partition(".")
        key, eq, raw = rest.partition("=")
        if not (dot and eq and name and key):
            raise ValueError(f"--variant_params expects NAME.KEY=VALUE (e.g. longformer.window=256), got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        parsed.setdefault(name, {})[key] = value
    return parsed


def make_contestants(names: list[str] | None, variant_params: dict[str, dict[str, Any]]) -> list[Contestant]:
    """Zoo variants and peers by name (default: every registered variant and every installed peer).

    A bad parameter raises :class:`VariantParameterError`; a variant that fails to load becomes a row with
    its error.
    """
    zoo_names = registered_names()
    if names is None:
        names = zoo_names + [p for p, cls in PEERS.items() if cls.installed()]
    unknown = [n for n in list(names) + list(variant_params) if n not in zoo_names and n not in PEERS]
    if unknown:
        raise ValueError(
            f"zoo bench: unknown variant or peer {unknown[0]!r}. Registered variants: {', '.join(zoo_names)}; "
            f"peers: {', '.join(PEERS)}."
        )
    contestants: list[Contestant] = []
    for name in dict.fromkeys(names):
        params = variant_params.get(name, {})
        if name in PEERS:
            if not PEERS[name].installed():
                raise ValueError(
                    f"zoo bench: peer {name!r} needs {PEERS[name].distribution}, which is not installed. "
                    "Install it with: pip install 'attention-zoo[bench]'."
                )
            contestants.append(PEERS[name](params, variant_params))
            continue
        try:
            contestants.append(ZooContestant(get_variant_class(name), params))
        except VariantParameterError:
            raise
        except Exception as exc:
            contestants.append(FailedContestant(name, describe_error(exc)))
    return contestants


# ---------------------------------------------------------------------------------------------------
# cost models and extrapolation


def total_flops(contestant: Contestant, settings: BenchSettings, n: int) -> float:
    """Attention FLOPs from the contestant's cost model plus the q/k/v projections, times the mode's passes."""
    head_dim = settings.hidden // settings.heads
    attention = contestant.flops(n, settings.heads, head_dim, settings.causal)
    projections = 3 * 2.0 * n * settings.hidden**2
    return settings.batch * settings.passes * (attention + projections)


def fit_exponent(lengths: list[int], values: list[float], fit_from: int = FIT_FROM) -> float | None:
    """Least-squares slope of log(value) against log(n), over lengths >= ``fit_from`` when at least two are
    present, else over all; None with fewer than two distinct lengths."""
    points = [(n, v) for n, v in zip(lengths, values, strict=True) if v is not None and v > 0]
    large = [p for p in points if p[0] >= fit_from]
    use = large if len({n for n, _ in large}) >= 2 else points
    if len({n for n, _ in use}) < 2:
        return None
    xs = [math.log(n) for n, _ in use]
    ys = [math.log(v) for _, v in use]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx


def extrapolate(points: list[tuple[int, float]], n: int, first_ratio, min_slope: float, max_slope: float = 2.2):
    """Value at n from the measured (length, value) points: the slope of the last two (clamped), or with one
    point ``first_ratio(n_last, n)``; None with no point."""
    if not points:
        return None
    n_last, v_last = points[-1]
    if len(points) == 1:
        return v_last * first_ratio(n_last, n)
    n_prev, v_prev = points[-2]
    slope = math.log(max(v_last, 1e-12) / max(v_prev, 1e-12)) / math.log(n_last / n_prev)
    return v_last * (n / n_last) ** min(max(slope, min_slope), max_slope)


def available_memory_bytes(settings: BenchSettings) -> float:
    """Memory a measurement may still take: free GPU memory on CUDA, else the kernel's MemAvailable."""
    if settings.device == "cuda":
        return float(torch.cuda.mem_get_info()[0])
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return float(fields["MemAvailable"].split()[0]) * 1024


# ---------------------------------------------------------------------------------------------------
# what to skip


@dataclass
class History:
    """What one contestant has measured so far (for extrapolation) and whether larger lengths are hopeless."""

    times: list[tuple[int, float]] = field(default_factory=list)
    memory: list[tuple[int, float]] = field(default_factory=list)
    failed_at: int | None = None
    failure: str = ""


def unsupported_reason(contestant: Contestant, settings: BenchSettings, n: int) -> str | None:
    """Why the contestant cannot run these settings at length n (its own limits, attention dropout), or None."""
    reason = contestant.unsupported(n, settings.causal)
    if reason is None and settings.dropout > 0 and not contestant.supports_dropout:
        reason = f"{contestant.name} has no attention dropout (--dropout {settings.dropout:g})"
    return reason


def skip_reason(contestant: Contestant, settings: BenchSettings, n: int, history: History, baseline: float):
    """A note for the table if (contestant, n) should not run, else None; also the estimated seconds."""
    reason = unsupported_reason(contestant, settings, n)
    if reason:
        return f"skipped: {reason}", None
    if history.failed_at is not None:
        return f"skipped: failed at n={history.failed_at} ({history.failure})", None
    est_time = extrapolate(
        history.times, n, lambda a, b: total_flops(contestant, settings, b) / total_flops(contestant, settings, a), 1.0
    )
    if est_time is not None and est_time > settings.max_seconds:
        return f"skipped: est. {est_time:.0f} s > --max_seconds {settings.max_seconds:g}", est_time
    # Before two lengths are measured, memory grows as the contestant's complexity says; after, as measured
    # (transformers' BigBird grows as n^1.6, not n², between 8K and 16K: a floor of 2 would skip it needlessly).
    growth = 2.0 if contestant.memory_grows_quadratically else 1.0
    est_net = extrapolate(history.memory, n, lambda a, b: (b / a) ** growth, 1.0)
    if est_net is not None:
        available = available_memory_bytes(settings)
        est_peak = est_net + (baseline if settings.device == "cpu" else 0.0)
        if est_peak > 0.9 * available:
            return f"skipped: est. {human_bytes(est_peak)} > {human_bytes(available)} available", est_time
    return None, est_time
