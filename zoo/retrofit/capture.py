"""Every attention layer's input and output under the original attention, captured with one forward per sequence and
kept on disk: one memory-mapped float32 array per layer and side, ``(sequences, length, hidden)``. Training a layer
reads only its own rows, so the memory a transfer needs is one model plus one layer's batch, whatever the number of
layers or tokens (the disk holds ``2 x layers x tokens x hidden x 4`` bytes; :attr:`Captured.disk_bytes`).

The layers are the model's attention modules (:func:`zoo.plug.weights.attention_modules`), called as the model calls
them: the keyword arguments other than the hidden states (rotary position embeddings, the padding mask, the cache
position) are kept from the first sequence; every sequence has the same length and no padding, so they serve all.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib.format import open_memmap

from zoo.plug.weights import attention_modules


def hidden_argument(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states an attention module is called with (first positional argument, or ``hidden_states=``)."""
    return args[0] if args else kwargs["hidden_states"]


def first_output(output: Any) -> torch.Tensor:
    """An attention module's output tensor (modules return ``(output, weights)``)."""
    return output[0] if isinstance(output, tuple) else output


class Captured:
    """The captured activations of ``layers`` for ``count`` sequences of ``length`` tokens, in ``folder``."""

    def __init__(self, folder: Path, layers: Sequence[int], count: int, length: int, hidden: int) -> None:
        self.folder, self.layers, self.count, self.length, self.hidden = folder, list(layers), count, length, hidden
        folder.mkdir(parents=True, exist_ok=True)
        shape = (count, length, hidden)
        self.inputs = {i: open_memmap(folder / f"layer{i}_in.npy", "w+", np.float32, shape) for i in self.layers}
        self.outputs = {i: open_memmap(folder / f"layer{i}_out.npy", "w+", np.float32, shape) for i in self.layers}
        self.call_args: dict[int, tuple[tuple, dict]] = {}

    @property
    def disk_bytes(self) -> int:
        return 2 * len(self.layers) * self.count * self.length * self.hidden * 4

    def batch(self, layer: int, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, outputs)`` of ``layer`` for the sequences ``rows``, as tensors ``(len(rows), length, hidden)``."""
        index = np.asarray(rows)
        return (torch.from_numpy(np.ascontiguousarray(self.inputs[layer][index])),
                torch.from_numpy(np.ascontiguousarray(self.outputs[layer][index])))

    def call(self, module: torch.nn.Module, layer: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """``module``'s output on ``hidden_states``, called with the other arguments the model gave ``layer``."""
        args, kwargs = self.call_args[layer]
        reference = next(module.parameters())
        return first_output(module(hidden_states.to(reference.device, reference.dtype), *args, **kwargs))

    def delete(self) -> None:
        """Free the disk (the arrays are closed first)."""
        self.inputs.clear()
        self.outputs.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def _kept(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple | list):
        return type(value)(_kept(v) for v in value)
    return value


@torch.no_grad()
def capture(model, sequences: torch.Tensor, folder: Path, layers: Sequence[int] | None = None) -> Captured:
    """Run ``model`` on each row of ``sequences`` ``(count, length)`` and record the attention layers' inputs and
    outputs (``layers``: their indices, default all) in ``folder``."""
    modules = {idx: module for _, idx, module in attention_modules(model)}
    chosen = list(modules) if layers is None else list(layers)
    missing = sorted(set(chosen) - set(modules))
    if missing:
        raise ValueError(f"retrofit: the model has no attention layers {missing}; it has 0..{len(modules) - 1}.")
    hidden = int(model.config.hidden_size)
    captured = Captured(folder, chosen, sequences.shape[0], sequences.shape[1], hidden)
    row = [0]
    handles = []

    def before(layer):
        def hook(module, args, kwargs):
            hidden_states = hidden_argument(args, kwargs)
            captured.inputs[layer][row[0]] = hidden_states[0].float().cpu().numpy()
            if layer not in captured.call_args:
                rest = {k: _kept(v) for k, v in kwargs.items() if k != "hidden_states"}
                captured.call_args[layer] = (_kept(args[1:]), rest)
        return hook

    def after(layer):
        def hook(module, args, kwargs, output):
            captured.outputs[layer][row[0]] = first_output(output)[0].float().cpu().numpy()
        return hook

    for layer in chosen:
        handles.append(modules[layer].register_forward_pre_hook(before(layer), with_kwargs=True))
        handles.append(modules[layer].register_forward_hook(after(layer), with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        for index in range(sequences.shape[0]):
            row[0] = index
            model(input_ids=sequences[index : index + 1].to(model.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    for arrays in (captured.inputs, captured.outputs):
        for array in arrays.values():
            array.flush()
    return captured
