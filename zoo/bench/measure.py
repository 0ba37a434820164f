"""Measurements of ``zoo bench`` and the process isolation they run in.

How memory is measured: on CPU every measurement runs in a fresh process (forked from a server that has
already imported torch, so a fork costs milliseconds) and reports its max RSS; the report shows it minus
the max RSS of an idle such process. On CUDA it is ``torch.cuda.max_memory_allocated`` in-process, and
time comes from CUDA events. Each measuring process may map only 90% of the memory still available, so a
kernel that outgrows the machine fails with an allocation error (recorded) instead of waking the OOM killer.
:class:`RssSampler` follows the resident memory of a process while a call runs (its peak per phase and per layer).
"""

from __future__ import annotations

import multiprocessing
import resource
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from zoo.bench.contestants import Contestant, QKVProjections, merge_heads
from zoo.bench.plan import DTYPES, BenchSettings, available_memory_bytes
from zoo.plug.dispatch import run_variant
from zoo.registry import get_variant_class
from zoo.reporting import describe_error, max_rss_bytes
from zoo.variant import AttentionCall

# ---------------------------------------------------------------------------------------------------
# measurements (run inside a fresh process on CPU, in-process on CUDA)


def _build(contestant: Contestant, settings: BenchSettings, n: int) -> tuple[QKVProjections, torch.nn.Module]:
    torch.manual_seed(0)
    proj = QKVProjections(settings.hidden, settings.heads)
    layer = contestant.build(proj, n, settings.causal, settings.dropout)
    return proj, layer.to(settings.device, DTYPES[settings.dtype]).train(settings.training)


def _inputs(settings: BenchSettings, n: int) -> torch.Tensor:
    shape = (settings.batch, n, settings.hidden)
    return torch.randn(shape, device=settings.device, dtype=DTYPES[settings.dtype], requires_grad=settings.backward)


def stopwatch(settings: BenchSettings):
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


def repeat_timed(step, settings: BenchSettings) -> list[float]:
    """``warmup`` untimed calls, then up to ``repeats`` timed ones (fewer once ``max_seconds`` of timing elapsed)."""
    timed = stopwatch(settings)
    for _ in range(settings.warmup):
        timed(step)
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < settings.repeats and (not times or time.perf_counter() - started < settings.max_seconds):
        times.append(timed(step))
    return times


def cuda_memory_start(settings: BenchSettings) -> int:
    """Reset CUDA's peak counter; the memory allocated before the measurement (0 on CPU)."""
    if settings.device != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def cuda_memory_result(settings: BenchSettings, start_bytes: int) -> dict[str, Any]:
    """The peak and the starting allocation of a CUDA measurement (nothing on CPU: the process's RSS is used)."""
    if settings.device != "cuda":
        return {}
    return {"peak_bytes": torch.cuda.max_memory_allocated(), "baseline_bytes": start_bytes}


def measure_time(contestant: Contestant, settings: BenchSettings, n: int) -> dict[str, Any]:
    """Warm-up, then up to ``repeats`` timed iterations of the layer (forward, or forward + backward)."""
    start_alloc = cuda_memory_start(settings)
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

    times = repeat_timed(step, settings)
    return {"status": "ok", "times": times, **cuda_memory_result(settings, start_alloc)}


def measure_error(contestant: Contestant, settings: BenchSettings) -> dict[str, Any]:
    """Relative Frobenius error against softmax attention restricted to the contestant's pattern (exact
    contestants) or full softmax attention (approximate ones), on the same q/k/v, in eval mode (no dropout)."""
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
    timed = stopwatch(settings)
    timed(lambda: a @ b)
    seconds = statistics.median(timed(lambda: a @ b) for _ in range(5))
    return {"status": "ok", "gflop_per_s": 2.0 * size**3 / seconds / 1e9}


def measure_idle() -> dict[str, Any]:
    """Nothing: its max RSS is the baseline (a process that imported torch, transformers and the zoo)."""
    return {"status": "ok"}


# ---------------------------------------------------------------------------------------------------
# resident memory while a call runs (the KV-cache benchmark's peak RSS per phase)


PAGE = 4096


def rss_now() -> int:
    """Current resident memory of this process (``/proc/self/statm``; 0 where there is none)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE
    except OSError:
        return 0


class RssSampler:
    """A thread that reads the current RSS every ``interval`` seconds: the peak since :meth:`mark` and, per decoder
    layer call (``hook``), the RSS after it, so the trace shows where (which chunk, which layer) memory grows."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self.stop = interval, rss_now(), threading.Event()
        self.trace: list[tuple[int, int]] = []  # (layer index, RSS MB after its call)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_now())
            time.sleep(self.interval)

    def mark(self) -> int:
        """The peak since the last mark (and reset it to the current RSS)."""
        peak, self.peak = max(self.peak, rss_now()), rss_now()
        return peak

    def hook(self, module, args, output) -> None:
        self.peak = max(self.peak, rss_now())
        self.trace.append((module.self_attn.layer_idx, rss_now() // 2**20))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


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
    result["max_rss_bytes"] = max_rss_bytes()
    conn.send(result)
    conn.close()


def _preload_modules(contestants: list[Contestant]) -> list[str]:
    modules = ["torch", "zoo", "zoo.bench.measure", "transformers"]
    for c in contestants:
        cls = getattr(c, "cls", None)
        if cls is not None:
            modules.append(cls.__module__)
        elif hasattr(c, "module"):
            modules.append(c.module)
    return list(dict.fromkeys(modules))


class Runner:
    """Runs measurement functions: each in a fresh forked process on CPU (max RSS is per process), in-process on
    CUDA (peak allocated memory is reset per measurement). A measurement returns a dict with ``status`` "ok"; an
    exception, a timeout or a dead process becomes ``{"status": "error", "error": ...}`` (``fatal`` for the
    last two)."""

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
