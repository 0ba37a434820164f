"""Which CPU code paths a run's arithmetic took, and how to pin them so another machine takes the same ones.

The same seeds, data, packages and thread counts give other numbers on another x86 machine because two libraries
pick their kernels by the CPU's instruction set: ATen's vectorized kernels (softmax, norms, reductions; AVX-512 or
AVX2 lanes sum in another order) and MKL's matrix products. Pinning both (``cpu_isa: avx2`` in a compare config)
gives the same bits on every Intel CPU with AVX2, at some speed; AMD and ARM CPUs take other paths whatever is set.
Measurements: docs/recipes/compare.md#reproducibility
"""

from __future__ import annotations

import os
import platform

import torch

# The environment that pins each choice: ATen's dispatch level, and MKL's conditional numerical reproducibility
# branch (deterministic reductions and a fixed code path; honoured on Intel CPUs only).
CPU_ISA_ENV: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"},
}
RECORDED_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS")


def pinned_env(cpu_isa: str | None) -> dict[str, str]:
    """The environment variables that pin ``cpu_isa`` (empty for None: the fastest paths of the machine).

    Raises:
        ValueError: ``cpu_isa`` is not a key of :data:`CPU_ISA_ENV`.
    """
    if cpu_isa is None:
        return {}
    if cpu_isa not in CPU_ISA_ENV:
        raise ValueError(f"cpu_isa {cpu_isa!r} is not known; use one of {', '.join(map(repr, CPU_ISA_ENV))} "
                         "(the same bits on every Intel CPU that has it), or null (each machine's fastest path).")
    return dict(CPU_ISA_ENV[cpu_isa])


def numerics_record() -> dict:
    """What decides a run's rounding on this machine: the CPU model, ATen's dispatch level, threads, and the
    environment variables that pin them (those set)."""
    return {
        "cpu": _cpu_model(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "env": {name: os.environ[name] for name in RECORDED_ENV if name in os.environ},
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), None)
    except OSError:  # not Linux
        return platform.processor() or None
