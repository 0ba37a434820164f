"""``zoo bench``: the O(n²) wall, measured.

One self-attention layer with its q/k/v projections, for every registered variant and the peers
(:mod:`zoo.bench_peers`), at each length: median time over repeats after a warm-up, measured peak memory,
achieved GFLOP/s against a dense-matmul roof measured in the same run, and the error against the dense
reference. Writes CSV, JSON, a markdown report and two log-log plots.

How memory is measured: on CPU every measurement runs in a fresh process (forked from a server that has
already imported torch, so a fork costs milliseconds) and reports its max RSS; the table shows it minus
the max RSS of an idle such process. On CUDA it is ``torch.cuda.max_memory_allocated`` in-process, and
time comes from CUDA events.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch

from zoo.bench_peers import PEERS, Contestant, QKVProjections, ZooContestant, merge_heads
from zoo.hf import run_variant
from zoo.registry import ENTRY_POINT_GROUP, get_variant_class, list_variants
from zoo.variant import AttentionCall, VariantParameterError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_LENGTHS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
WALL_LENGTHS = [512, 2048, 8192, 32768]
FIT_FROM = 4096  # exponents are fitted over lengths >= this when two or more are present
QUICK = {"lengths": [512, 1024], "repeats": 1, "warmup": 1, "error_length": 512, "roof_size": 1024,
         "max_seconds": 20.0}
NORMAL = {"lengths": DEFAULT_LENGTHS, "repeats": 3, "warmup": 1, "error_length": 1024, "roof_size": 2048,
          "max_seconds": 120.0}
MB = 2**20


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

    @property
    def backward(self) -> bool:
        return self.mode == "fwd+bwd"

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
        if self.device == "cuda" and not torch.cuda.is_available():
            problems.append("--device cuda but torch sees no CUDA GPU here (use --device cpu)")
        if problems:
            raise ValueError("zoo bench: " + "; ".join(problems) + ".")


# ---------------------------------------------------------------------------------------------------
# measurements (run inside a fresh process on CPU, in-process on CUDA)


def _build(contestant: Contestant, settings: BenchSettings, n: int) -> tuple[QKVProjections, torch.nn.Module]:
    torch.manual_seed(0)
    proj = QKVProjections(settings.hidden, settings.heads)
    layer = contestant.build(proj, n, settings.causal).to(settings.device, DTYPES[settings.dtype])
    return proj, layer.train(settings.backward)


def _inputs(settings: BenchSettings, n: int) -> torch.Tensor:
    shape = (settings.batch, n, settings.hidden)
    return torch.randn(shape, device=settings.device, dtype=DTYPES[settings.dtype], requires_grad=settings.backward)


def _stopwatch(settings: BenchSettings):
    """A function timing ``step()`` in seconds: CUDA events on a GPU, perf_counter on CPU."""
    if settings.device == "cuda":

        def timed(step) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000.0

        return timed

    def timed(step) -> float:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    return timed


def measure_time(contestant: Contestant, settings: BenchSettings, n: int) -> dict[str, Any]:
    """Warm-up, then up to ``repeats`` timed iterations (fewer once ``max_seconds`` of timing has elapsed)."""
    if settings.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start_alloc = torch.cuda.memory_allocated() if settings.device == "cuda" else 0
    _, layer = _build(contestant, settings, n)
    x = _inputs(settings, n)
    grad_out = torch.randn_like(x) if settings.backward else None

    def step() -> None:
        if settings.backward:
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x).backward(grad_out)
        else:
            with torch.no_grad():
                layer(x)

    timed = _stopwatch(settings)
    for _ in range(settings.warmup):
        timed(step)
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < settings.repeats and (not times or time.perf_counter() - started < settings.max_seconds):
        times.append(timed(step))
    result: dict[str, Any] = {"status": "ok", "times": times}
    if settings.device == "cuda":
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
        result["baseline_bytes"] = start_alloc
    return result


def measure_error(contestant: Contestant, settings: BenchSettings) -> dict[str, Any]:
    """Relative Frobenius error against softmax attention restricted to the contestant's pattern (exact
    contestants) or full softmax attention (approximate ones), on the same q/k/v, in eval mode."""
    n = settings.error_length
    proj, layer = _build(contestant, settings, n)
    layer.eval()
    x = _inputs(settings, n).detach()
    with torch.no_grad():
        out = layer(x).float()
        q, k, v = proj.split(x)
        dense = get_variant_class("dense")(pattern=contestant.reference_pattern(layer))
        call = AttentionCall(causal=settings.causal, scaling=q.shape[-1] ** -0.5)
        reference = merge_heads(run_variant(dense, q, k, v, call)).float()
    return {"status": "ok", "rel_error": float(torch.linalg.norm(out - reference) / torch.linalg.norm(reference))}


def measure_roof(settings: BenchSettings) -> dict[str, Any]:
    """GFLOP/s of a large dense matmul in the benchmark's dtype: the ceiling the variants are held against."""
    size = settings.roof_size
    a, b = (torch.randn(size, size, device=settings.device, dtype=DTYPES[settings.dtype]) for _ in range(2))
    timed = _stopwatch(settings)
    timed(lambda: a @ b)
    seconds = statistics.median(timed(lambda: a @ b) for _ in range(5))
    return {"status": "ok", "gflop_per_s": 2.0 * size**3 / seconds / 1e9}


def measure_idle() -> dict[str, Any]:
    """Nothing: its max RSS is the baseline (a process that imported torch, transformers and the zoo)."""
    return {"status": "ok"}


def describe_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__
    return text[:300]


# ---------------------------------------------------------------------------------------------------
# process isolation


def _cap_memory(extra_bytes: float) -> None:
    """Let this process map at most ``extra_bytes`` more data: a kernel that outgrows the machine then fails
    with a clear allocation error (recorded in the table) instead of waking the OOM killer."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    limit = int(fields["VmData"].split()[0]) * 1024 + int(extra_bytes)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _child_main(conn, threads: int, memory_cap: float, fn, args: tuple) -> None:
    _cap_memory(memory_cap)
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", message="attention-zoo: plugin entry point")  # the parent showed them
    try:
        result = fn(*args)
    except Exception as exc:  # recorded in the table; the benchmark goes on
        result = {"status": "error", "error": describe_error(exc)}
    result["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    conn.send(result)
    conn.close()


def _preload_modules(contestants: list[Contestant]) -> list[str]:
    modules = ["torch", "zoo", "zoo.bench", "transformers"]
    for c in contestants:
        cls = getattr(c, "cls", None)
        if cls is not None:
            modules.append(cls.__module__)
        elif hasattr(c, "module"):
            modules.append(c.module)
    return list(dict.fromkeys(modules))


class Runner:
    """Runs measurement functions: each in a fresh forked process on CPU (max RSS is per process), in-process on
    CUDA (peak allocated memory is reset per measurement)."""

    def __init__(self, settings: BenchSettings, contestants: list[Contestant]) -> None:
        self.settings = settings
        self.isolated = settings.device == "cpu"
        if self.isolated:
            self.context = multiprocessing.get_context("forkserver")
            self.context.set_forkserver_preload(_preload_modules(contestants))

    def run(self, fn, *args, timeout: float) -> dict[str, Any]:
        if not self.isolated:
            torch.set_num_threads(self.settings.threads)
            try:
                return fn(*args)
            except Exception as exc:
                return {"status": "error", "error": describe_error(exc)}
            finally:
                torch.cuda.empty_cache()
        receiver, sender = self.context.Pipe(duplex=False)
        memory_cap = 0.9 * available_memory_bytes(self.settings)
        process = self.context.Process(
            target=_child_main, args=(sender, self.settings.threads, memory_cap, fn, args), daemon=True
        )
        try:
            process.start()
        except Exception as exc:  # e.g. a variant class that cannot be pickled
            return {"status": "error", "error": f"could not start the measuring process: {describe_error(exc)}"}
        sender.close()
        try:
            if receiver.poll(timeout):
                return receiver.recv()
            process.kill()
            return {"status": "error", "error": f"timed out after {timeout:.0f} s", "fatal": True}
        except EOFError:
            process.join()
            code = process.exitcode
            why = "killed (SIGKILL: probably out of memory)" if code == -9 else f"exit code {code}"
            return {"status": "error", "error": f"the measuring process died: {why}", "fatal": True}
        finally:
            process.join(timeout=30)
            receiver.close()


# ---------------------------------------------------------------------------------------------------
# planning: what to skip


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
    if settings.device == "cuda":
        return float(torch.cuda.mem_get_info()[0])
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return float(fields["MemAvailable"].split()[0]) * 1024


def total_flops(contestant: Contestant, settings: BenchSettings, n: int) -> float:
    """Attention FLOPs from the contestant's cost model plus the q/k/v projections, times the mode's passes."""
    head_dim = settings.hidden // settings.heads
    attention = contestant.flops(n, settings.heads, head_dim, settings.causal)
    projections = 3 * 2.0 * n * settings.hidden**2
    return settings.batch * settings.passes * (attention + projections)


def human_bytes(value: float) -> str:
    for unit, scale in (("TB", 2**40), ("GB", 2**30), ("MB", 2**20)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value / 2**10:.0f} KB"


@dataclass
class History:
    """What one contestant has measured so far (for extrapolation) and whether larger lengths are hopeless."""

    times: list[tuple[int, float]] = field(default_factory=list)
    memory: list[tuple[int, float]] = field(default_factory=list)
    failed_at: int | None = None
    failure: str = ""


def skip_reason(contestant: Contestant, settings: BenchSettings, n: int, history: History, baseline: float):
    """A note for the table if (contestant, n) should not run, else None; also the estimated seconds."""
    reason = contestant.unsupported(n, settings.causal)
    if reason:
        return f"skipped: {reason}", None
    if history.failed_at is not None:
        return f"skipped: failed at n={history.failed_at} ({history.failure})", None
    est_time = extrapolate(
        history.times, n, lambda a, b: total_flops(contestant, settings, b) / total_flops(contestant, settings, a), 1.0
    )
    if est_time is not None and est_time > settings.max_seconds:
        return f"skipped: est. {est_time:.0f} s > --max-seconds {settings.max_seconds:g}", est_time
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


# ---------------------------------------------------------------------------------------------------
# the run


class FailedContestant(Contestant):
    """A contestant that could not even be set up (e.g. a plugin whose entry point fails to import)."""

    kind = "zoo"
    exact = True
    time_complexity = memory_complexity = "–"

    def __init__(self, name: str, error: str) -> None:
        super().__init__({})
        self.name, self.error = name, error

    def source(self) -> tuple[str, str]:
        return "", ""


def _row(contestant: Contestant, settings: BenchSettings, n: int, **values: Any) -> dict[str, Any]:
    row = {"variant": contestant.name, "kind": contestant.kind, "n": n, "status": "ok", "note": ""}
    row.update(values)
    return row


def _measure_row(contestant, settings, n, runner, history, baseline) -> dict[str, Any]:
    if isinstance(contestant, FailedContestant):
        return _row(contestant, settings, n, status="error", note=f"error: {contestant.error}")
    note, est_time = skip_reason(contestant, settings, n, history, baseline)
    if note:
        return _row(contestant, settings, n, status="skipped", note=note)
    timeout = 60 + 3 * settings.max_seconds * (settings.warmup + 2)
    result = runner.run(measure_time, contestant, settings, n, timeout=timeout)
    if result["status"] != "ok":
        if result.get("fatal") or "memory" in result["error"].lower():
            history.failed_at, history.failure = n, result["error"]
        return _row(contestant, settings, n, status="error", note=f"error: {result['error']}")
    seconds = statistics.median(result["times"])
    if settings.device == "cuda":
        peak, net = result["peak_bytes"], result["peak_bytes"] - result["baseline_bytes"]
    else:
        peak, net = result["max_rss_bytes"], result["max_rss_bytes"] - baseline
    history.times.append((n, seconds))
    history.memory.append((n, max(net, 1.0)))
    flops = total_flops(contestant, settings, n)
    return _row(
        contestant, settings, n, time_s=seconds, time_min_s=min(result["times"]), repeats=len(result["times"]),
        peak_mb=peak / MB, mem_mb=net / MB, gflop=flops / 1e9, gflop_per_s=flops / seconds / 1e9,
        est_time_s=est_time,
    )


def _error_entry(contestant: Contestant, settings: BenchSettings, runner: Runner) -> dict[str, Any]:
    n = settings.error_length
    if isinstance(contestant, FailedContestant):
        return {"rel_error": None, "error_note": f"error: {contestant.error}"}
    reason = contestant.unsupported(n, settings.causal)
    if reason:
        return {"rel_error": None, "error_note": f"n/a at n={n}: {reason}"}
    if not contestant.has_reference:
        return {"rel_error": None, "error_note": "n/a: its random blocks are drawn inside transformers"}
    result = runner.run(measure_error, contestant, settings, timeout=600)
    if result["status"] != "ok":
        return {"rel_error": None, "error_note": f"error: {result['error']}"}
    return {"rel_error": result["rel_error"], "error_note": ""}


def run_benchmark(settings: BenchSettings, contestants: list[Contestant], progress: bool = True) -> dict[str, Any]:
    """Measure every contestant at every length; returns the report dict (see :func:`write_outputs`)."""
    from tqdm.auto import tqdm

    settings.check()
    runner = Runner(settings, contestants)
    total = 2 + len(settings.lengths) * len(contestants) + len(contestants)
    bar = tqdm(total=total, desc="zoo bench", unit="run", disable=not progress)
    bar.set_postfix_str("matmul roof")
    roof = runner.run(measure_roof, settings, timeout=600)
    bar.update()
    baseline = 0.0
    if runner.isolated:
        bar.set_postfix_str("idle process")
        baseline = float(runner.run(measure_idle, timeout=600).get("max_rss_bytes", 0))
    bar.update()
    histories = {c.name: History() for c in contestants}
    rows = []
    for n in sorted(set(settings.lengths)):  # lengths outside, contestants inside: drift hits all alike
        for contestant in contestants:
            bar.set_postfix_str(f"{contestant.name} n={n}")
            rows.append(_measure_row(contestant, settings, n, runner, histories[contestant.name], baseline))
            bar.update()
    errors = {}
    for contestant in contestants:
        bar.set_postfix_str(f"{contestant.name} error at n={settings.error_length}")
        errors[contestant.name] = _error_entry(contestant, settings, runner)
        bar.update()
    bar.close()
    return assemble_report(settings, contestants, rows, errors, roof, baseline)


# ---------------------------------------------------------------------------------------------------
# the report


def machine_info(settings: BenchSettings) -> dict[str, Any]:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_total": human_bytes(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": settings.threads,
    }
    if settings.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def peers_of(name: str, contestants: list[Contestant]) -> list[str]:
    return [c.name for c in contestants if name in c.matches]


def assemble_report(settings, contestants, rows, errors, roof, baseline) -> dict[str, Any]:
    """Add ratios (against sdpa and the matching peers), exponents and the roof fraction to the raw rows."""
    roof_gflops = roof.get("gflop_per_s") if roof.get("status") == "ok" else None
    by_key = {(r["variant"], r["n"]): r for r in rows if r["status"] == "ok"}
    for row in rows:
        row.update(errors.get(row["variant"], {}), error_n=settings.error_length)
        if row["status"] != "ok":
            continue
        if roof_gflops:
            row["roof_pct"] = 100.0 * row["gflop_per_s"] / roof_gflops
        sdpa = by_key.get(("sdpa", row["n"]))
        if sdpa:
            row["speedup_vs_sdpa"] = sdpa["time_s"] / row["time_s"]
            row["mem_vs_sdpa"] = row["mem_mb"] / sdpa["mem_mb"] if sdpa["mem_mb"] > 0 else None
        for peer_name in peers_of(row["variant"], contestants)[:1]:  # the CSV keeps the first (transformers) peer
            peer = by_key.get((peer_name, row["n"]))
            row["peer"] = peer_name
            if peer:
                row["speedup_vs_peer"] = peer["time_s"] / row["time_s"]
                row["mem_vs_peer"] = row["mem_mb"] / peer["mem_mb"] if peer["mem_mb"] > 0 else None
    variants = {}
    for c in contestants:
        ok = [r for r in rows if r["variant"] == c.name and r["status"] == "ok"]
        distribution, version = c.source()
        variants[c.name] = {
            "kind": c.kind,
            "package": distribution,
            "version": version,
            "params": c.params,
            "exact": c.exact,
            "time_complexity": c.time_complexity,
            "memory_complexity": c.memory_complexity,
            "peers": peers_of(c.name, contestants),
            "time_exponent": fit_exponent([r["n"] for r in ok], [r["time_s"] for r in ok]),
            "memory_exponent": fit_exponent([r["n"] for r in ok], [r["mem_mb"] for r in ok]),
            **errors.get(c.name, {}),
        }
    return {
        "settings": asdict(settings),
        "machine": machine_info(settings),
        "roof_gflop_per_s": roof_gflops,
        "roof_note": "" if roof_gflops else roof.get("error", ""),
        "baseline_rss_mb": baseline / MB,
        "variants": variants,
        "rows": rows,
    }


CSV_FIELDS = [
    "variant", "kind", "n", "status", "note", "time_s", "time_min_s", "repeats", "mem_mb", "peak_mb", "gflop",
    "gflop_per_s", "roof_pct", "speedup_vs_sdpa", "mem_vs_sdpa", "peer", "speedup_vs_peer", "mem_vs_peer",
    "rel_error", "error_n", "error_note", "est_time_s",
]


def write_csv(report: dict[str, Any], path: Path) -> None:
    settings = report["settings"]
    extra = ["batch", "hidden", "heads", "dtype", "mode", "causal", "device", "threads"]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS + extra + ["params"], extrasaction="ignore")
        writer.writeheader()
        for row in report["rows"]:
            params = json.dumps(report["variants"][row["variant"]]["params"], sort_keys=True)
            writer.writerow({**row, **{k: settings[k] for k in extra}, "params": params})


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}{suffix}" if abs(value) < 10**digits else f"{value:.0f}{suffix}"


def _grid(report, cell) -> list[str]:
    """A markdown table: one row per contestant, one column per length; ``cell(row) -> str`` for measured ones."""
    lengths = sorted({r["n"] for r in report["rows"]})
    lines = ["| variant | " + " | ".join(f"n={n}" for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for name in report["variants"]:
        cells = []
        for n in lengths:
            row = next(r for r in report["rows"] if r["variant"] == name and r["n"] == n)
            cells.append(cell(row) if row["status"] == "ok" else short_note(row))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def short_note(row: dict[str, Any]) -> str:
    """A skip note in full (it says why); an error as its exception type (the message is listed under Errors)."""
    if row["status"] == "error":
        return row["note"].split(":", 2)[0] + ": " + row["note"].split(":", 2)[1].strip() + " (see Errors)"
    return row["note"]


def _errors_section(report) -> list[str]:
    """Each distinct error message once, with the lengths it happened at."""
    seen: dict[tuple[str, str], list[str]] = {}
    for row in report["rows"]:
        if row["status"] == "error":
            seen.setdefault((row["variant"], row["note"]), []).append(f"n={row['n']}")
    check = f"error check at n={report['settings']['error_length']}"
    for name, info in report["variants"].items():
        if info.get("error_note", "").startswith("error"):
            seen.setdefault((name, info["error_note"]), []).append(check)
    return [f"- **{name}** ({', '.join(where)}): {note}" for (name, note), where in seen.items()] or ["none"]


def _ratio_cell(speed: float | None, memory: float | None) -> str:
    if speed is None:
        return "–"
    return f"{speed:.2f}x speed, {_fmt(memory)}x memory"


def _peer_pairs_table(report) -> list[str]:
    lengths = sorted({r["n"] for r in report["rows"]})
    ok = {(r["variant"], r["n"]): r for r in report["rows"] if r["status"] == "ok"}
    lines = ["| variant vs peer | " + " | ".join(f"n={n}" for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for name, info in report["variants"].items():
        for peer in info["peers"]:
            cells = []
            for n in lengths:
                mine, theirs = ok.get((name, n)), ok.get((peer, n))
                if mine and theirs:
                    memory = mine["mem_mb"] / theirs["mem_mb"] if theirs["mem_mb"] > 0 else None
                    cells.append(_ratio_cell(theirs["time_s"] / mine["time_s"], memory))
                else:
                    cells.append("–")
            lines.append(f"| {name} vs {peer} | " + " | ".join(cells) + " |")
    return lines


def _summary_table(report) -> list[str]:
    lines = [
        "| variant | source | params | time, memory | time exponent | memory exponent | GFLOP/s at largest n | "
        "% of roof | rel. error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, info in report["variants"].items():
        ok = [r for r in report["rows"] if r["variant"] == name and r["status"] == "ok"]
        last = ok[-1] if ok else {}
        at = f" (n={last['n']})" if last else ""
        error = _fmt(info.get("rel_error"), 4) if info.get("rel_error") is not None else info.get("error_note", "")
        if error.startswith("error"):
            error = "error (see Errors)"
        params = ", ".join(f"{k}={v}" for k, v in info["params"].items()) or "-"
        complexity = f"{info['time_complexity']}, {info['memory_complexity']}"
        lines.append(
            f"| {name} | {info['package']} {info['version']} | {params} | {complexity} | "
            f"{_fmt(info['time_exponent'])} | {_fmt(info['memory_exponent'])} | "
            f"{_fmt(last.get('gflop_per_s'), 1)}{at} | "
            f"{_fmt(last.get('roof_pct'), 1)} | {error} |"
        )
    return lines


def _wall_table(report) -> list[str]:
    """The seed's table: attention-matrix size and theoretical O(n²) cost beside measured relative cost."""
    heads = report["settings"]["heads"]
    base = WALL_LENGTHS[0]
    lines = ["| | " + " | ".join(f"n={n}" for n in WALL_LENGTHS) + " |", "|---" * (len(WALL_LENGTHS) + 1) + "|"]
    lines.append("| attention matrix entries per head (n²) | " + " | ".join(f"{n * n:,}" for n in WALL_LENGTHS) + " |")
    lines.append(
        f"| fp32 scores, {heads} heads, one layer | " + " | ".join(human_bytes(4 * heads * n * n) for n in WALL_LENGTHS)
        + " |"
    )
    lines.append("| theoretical relative cost O(n²) | " + " | ".join(f"{(n / base) ** 2:,.0f}x" for n in WALL_LENGTHS)
                 + " |")
    ok = {(r["variant"], r["n"]): r for r in report["rows"] if r["status"] == "ok"}
    for name in report["variants"]:
        measured = [n for n in WALL_LENGTHS if (name, n) in ok]
        if not measured:
            continue
        first = ok[(name, measured[0])]
        cells = []
        for n in WALL_LENGTHS:
            row = ok.get((name, n))
            if row is None:
                other = next((r for r in report["rows"] if r["variant"] == name and r["n"] == n), None)
                cells.append(short_note(other) if other and other["status"] != "ok" else "–")
                continue
            memory = row["mem_mb"] / first["mem_mb"] if first["mem_mb"] > 0 else None
            cells.append(f"time {row['time_s'] / first['time_s']:,.1f}x, memory {_fmt(memory, 1)}x")
        label = name if measured[0] == base else f"{name} (relative to n={measured[0]})"
        lines.append(f"| {label}: measured | " + " | ".join(cells) + " |")
    return lines


def render_markdown(report: dict[str, Any], command: str) -> str:
    s, m = report["settings"], report["machine"]
    roof = report["roof_gflop_per_s"]
    where = m.get("gpu") or f"{m['cpu']}, {m['cpu_count']} cores, {m['memory_total']}"
    lines = [
        "# zoo bench",
        "",
        f"`{command}`",
        "",
        f"One self-attention layer with its q/k/v projections: hidden {s['hidden']}, {s['heads']} heads, batch "
        f"{s['batch']}, {s['dtype']}, {s['mode']}, {'causal' if s['causal'] else 'bidirectional'}, {s['device']}, "
        f"{s['threads']} threads; median of up to {s['repeats']} repeats after {s['warmup']} warm-up.",
        f"Machine: {where}; torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}.",
        f"Dense-matmul roof measured in this run: {_fmt(roof, 1)} GFLOP/s {report['roof_note']}".rstrip() + ".",
    ]
    if s["device"] == "cpu":
        lines.append(
            f"Memory: max RSS of the fresh process that ran the measurement minus that of an idle one "
            f"({report['baseline_rss_mb']:.0f} MB, torch and transformers imported); raw values in the CSV."
        )
    else:
        lines.append("Memory: torch.cuda.max_memory_allocated during the measurement.")
    sections = [
        ("Time (s)", _grid(report, lambda r: _fmt(r["time_s"], 3))),
        ("Peak memory (MB above an idle process)", _grid(report, lambda r: _fmt(r["mem_mb"], 0))),
        ("Against sdpa (speed = sdpa time / variant time, above 1 is faster; memory = variant / sdpa)",
         _grid(report, lambda r: _ratio_cell(r.get("speedup_vs_sdpa"), r.get("mem_vs_sdpa")))),
        ("Against the matching peer (speed = peer time / variant time, above 1 is faster; memory = variant / peer)",
         _peer_pairs_table(report)),
        (f"Per variant (exponents fitted on log-log over n >= {FIT_FROM} when two such lengths were measured, else "
         f"all; error: relative Frobenius error at n={s['error_length']} against softmax attention restricted to "
         f"the pattern, or full softmax for approximate variants)", _summary_table(report)),
        ("The O(n²) wall (measured values relative to each variant's own at the first length)",
         _wall_table(report)),
    ]
    sections.append(("Errors", _errors_section(report)))
    for title, table in sections:
        lines += ["", f"## {title}", "", *table]
    lines += ["", "![time vs n](time_vs_n.png)", "", "![memory vs n](memory_vs_n.png)", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], key: str, ylabel: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    lengths = sorted({r["n"] for r in report["rows"]})
    palette = plt.get_cmap("tab20").colors
    colors = palette[0::2] + palette[1::2]  # the 10 strong colours first, their light twins after
    lowest = []
    for i, (name, info) in enumerate(report["variants"].items()):
        ok = [r for r in report["rows"] if r["variant"] == name and r["status"] == "ok" and r[key] > 0]
        if ok:
            style = "--" if info["kind"] == "peer" else "-"
            ax.plot([r["n"] for r in ok], [r[key] for r in ok], style, marker="o", markersize=3, label=name,
                    color=colors[i % len(colors)])
            lowest.append(min(r[key] for r in ok if r["n"] == ok[0]["n"]))
    if lowest and len(lengths) > 1:  # guides: how O(n) and O(n²) would grow from the lowest first point
        start = min(lowest)
        for power, label in ((1, "∝ n"), (2, "∝ n²")):
            ax.plot(lengths, [start * (n / lengths[0]) ** power for n in lengths], ":", color="grey", linewidth=1)
            ax.annotate(label, (lengths[-1], start * (lengths[-1] / lengths[0]) ** power), color="grey", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths], rotation=45)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel(ylabel)
    s = report["settings"]
    ax.set_title(f"{ylabel}: one attention layer, hidden {s['hidden']}, {s['dtype']} {s['mode']}, {s['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict[str, Any], output_dir: Path, command: str) -> dict[str, Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "csv": output_dir / "bench.csv",
        "json": output_dir / "bench.json",
        "markdown": output_dir / "bench.md",
        "time_plot": output_dir / "time_vs_n.png",
        "memory_plot": output_dir / "memory_vs_n.png",
    }
    write_csv(report, paths["csv"])
    paths["json"].write_text(json.dumps({**report, "command": command}, indent=2, default=str))
    paths["markdown"].write_text(render_markdown(report, command))
    plot(report, "time_s", "time (s)", paths["time_plot"])
    plot(report, "mem_mb", "peak memory (MB)", paths["memory_plot"])
    return paths


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
            raise ValueError(f"--variant-params expects NAME.KEY=VALUE (e.g. longformer.window=256), got {item!r}")
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
# command line


def add_subcommand(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure time, memory, GFLOP/s and error of every variant and the peers against n",
        description="Measure time, peak memory, GFLOP/s and error of one attention layer with its q/k/v "
        "projections, for every registered variant and the peers, against the sequence length n.",
    )
    p.add_argument("--variants", nargs="+", help="variants and peers to run (default: all registered + peers)")
    p.add_argument("--lengths", nargs="+", type=int, help=f"sequence lengths (default {DEFAULT_LENGTHS})")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--mode", choices=["fwd", "fwd+bwd"], default="fwd+bwd")
    p.add_argument("--causal", action="store_true", help="causal attention (the transformers peers are skipped)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default here)")
    p.add_argument("--repeats", type=int, help="timed iterations per measurement (default 3; quick 1)")
    p.add_argument("--warmup", type=int, help="untimed iterations first (default 1)")
    p.add_argument("--max-seconds", type=float,
                   help="skip a combination whose estimated time for one iteration exceeds this (default 120)")
    p.add_argument("--error-length", type=int, help="n at which the error against dense is measured (default 1024)")
    p.add_argument("--roof-size", type=int, help="size of the square matmul measuring the roof (default 2048)")
    p.add_argument("--variant-params", nargs="+", default=[], metavar="NAME.KEY=VALUE",
                   help="override a parameter, e.g. longformer.window=256 hf_bigbird.num_random_blocks=2")
    p.add_argument("--quick", action="store_true", help="n in {512, 1024}, one repeat: under a minute")
    p.add_argument("--output-dir", type=Path, default=Path("runs/bench"), help="default: runs/bench")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_bench)


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    preset = QUICK if args.quick else NORMAL
    pick = {key: getattr(args, key) if getattr(args, key) is not None else preset[key] for key in preset}
    return BenchSettings(
        hidden=args.hidden, heads=args.heads, batch=args.batch, dtype=args.dtype, mode=args.mode, causal=args.causal,
        device=args.device, threads=args.threads or torch.get_num_threads(), **pick,
    )


def command_line(settings: BenchSettings, args: argparse.Namespace) -> str:
    """The run as one explicit command (every setting spelled out), for the report."""
    parts = ["zoo bench"]
    if args.variants:
        parts.append("--variants " + " ".join(args.variants))
    parts.append("--lengths " + " ".join(map(str, settings.lengths)))
    parts.append(f"--hidden {settings.hidden} --heads {settings.heads} --batch {settings.batch}")
    parts.append(f"--dtype {settings.dtype} --mode {settings.mode} --device {settings.device}")
    parts.append(f"--threads {settings.threads} --repeats {settings.repeats} --warmup {settings.warmup}")
    parts.append(f"--max-seconds {settings.max_seconds:g} --error-length {settings.error_length}")
    if settings.causal:
        parts.append("--causal")
    if args.variant_params:
        parts.append("--variant-params " + " ".join(args.variant_params))
    parts.append(f"--output-dir {args.output_dir}")
    return " ".join(parts)


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        settings.check()
        contestants = make_contestants(args.variants, parse_variant_params(args.variant_params))
    except ValueError as exc:  # VariantParameterError included
        print(str(exc), file=sys.stderr)
        return 2
    report = run_benchmark(settings, contestants, progress=not args.no_progress)
    paths = write_outputs(report, args.output_dir, command_line(settings, args))
    failed = sorted({r["variant"] for r in report["rows"] if r["status"] == "error"})
    print(f"zoo bench: wrote {', '.join(str(p) for p in paths.values())}")
    if failed:
        print(f"zoo bench: errors recorded for {', '.join(failed)} (see the note column)")
    return 0
