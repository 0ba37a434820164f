"""Recurrent-state helpers shared by the recurrent kernels (``delta_rule``, ``gated_linear``, ``based``'s linear
attention): the dtype states accumulate in, autocast kept off around them, and carrying a kernel's final state across
calls in a state dict."""

from __future__ import annotations

import contextlib

import torch


def autocast_off(device_type: str):
    """A region where autocast is off, as a context manager: ``torch.autocast(enabled=False)`` when autocast is on,
    else nothing to enter (the plug already turned it off around every kernel, and a decoding step is a few dozen
    small ops, each context a measurable share)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def state_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs, else fp32: the dtype states are accumulated in."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def carried(kernel, state: dict | None, key: str, *args, **kwargs) -> torch.Tensor:
    """``kernel(*args, initial_state=state[key])``'s output, ``state[key]`` replaced by its final state; without a
    ``state`` (a recurrent cache's dict) it starts from zeros and keeps nothing."""
    out, final = kernel(*args, initial_state=None if state is None else state.get(key), **kwargs)
    if state is not None:
        state[key] = final
    return out
