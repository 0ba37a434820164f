"""Which layers keep the original attention. Measured (KL-guided layer selection, arXiv 2512.20569): swap one layer at
a time for its transferred variant and measure how far the model's next-token distribution moves on held-out text
(:func:`swap_kl`); keep full attention where it moves most. Or by a fixed pattern (``every: 4``, the 3:1 interleave of
Qwen3-Next and Kimi Linear), by the transfer error, or an explicit list.

A layout is applied to the model as a ``hybrid`` config (``sdpa`` in kept layers, the variant elsewhere) with each
layer's weights: the transferred ones (variant weights, LoRA merged into q/k/v) where converted, the original ones
where kept (:func:`apply_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from zoo.plug.install import configure
from zoo.plug.weights import WEIGHTS_NAME, attention_modules
from zoo.training.finetune import ATTENTION_DROPOUT_KEYS

KEEP = "sdpa"  # what a kept layer runs: torch's SDPA, the original attention
LAYOUT_KEYS = {"name", "keep_full", "by", "every", "offset", "keep"}


def without_attention_dropout(model) -> None:
    """Set the config's attention dropout to 0 (GPT-2's ``attn_pdrop`` is 0.1): the transfer compares outputs in
    eval mode, and a variant without dropout support is refused while the config asks for dropout."""
    for key in ATTENTION_DROPOUT_KEYS:
        if getattr(model.config, key, None):
            setattr(model.config, key, 0.0)
    for _, _, module in attention_modules(model):  # what the modules read at init (Llama's float, GPT-2's Dropout)
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
        for inner in module.modules():
            if isinstance(inner, torch.nn.Dropout):
                inner.p = 0.0


def hybrid_layers(count: int, converted: Iterable[int], entry: dict[str, Any]) -> list:
    """The ``hybrid`` variant's ``layers``: ``entry`` (``{variant, params}``) where converted, sdpa elsewhere."""
    converted = set(converted)
    return [dict(entry) if i in converted else KEEP for i in range(count)]


def attention_states(model) -> dict[int, dict[str, torch.Tensor]]:
    """Each attention module's state (a copy), by layer index."""
    return {idx: {k: v.detach().clone() for k, v in module.state_dict().items()}
            for _, idx, module in attention_modules(model)}


def configure_keeping_weights(model, layers: list) -> None:
    """Configure ``model`` as the ``hybrid`` of ``layers`` keeping each layer's variant weights (``configure`` draws
    new ones): a stage of the transfer switches the parameters of the converted layers, not their weights."""
    kept = {
        idx: module._modules[WEIGHTS_NAME].state_dict()
        for _, idx, module in attention_modules(model)
        if WEIGHTS_NAME in module._modules
    }
    configure(model, "hybrid", layers=layers)
    for _, idx, module in attention_modules(model):
        if idx in kept:
            module._modules[WEIGHTS_NAME].load_state_dict(kept[idx])


def apply_layout(model, converted: Iterable[int], entry: dict[str, Any], transferred: Mapping[int, dict],
                 original: Mapping[int, dict]) -> list:
    """Configure ``model`` as the hybrid of ``converted`` layers and load each layer's weights; returns ``layers``."""
    converted = set(converted)
    modules = list(attention_modules(model))
    missing = sorted(converted - set(transferred))
    if missing:
        raise ValueError(f"retrofit: layers {missing} were not transferred (stage 1 trained {sorted(transferred)}).")
    layers = hybrid_layers(len(modules), converted, entry)
    configure(model, "hybrid", layers=layers)
    for _, idx, module in modules:
        module.load_state_dict(transferred[idx] if idx in converted else original[idx], strict=True)
    return layers


@torch.no_grad()
def next_token_logprobs(model, sequences: torch.Tensor) -> torch.Tensor:
    """``(count, length - 1, vocab)`` float32 log-probabilities of each next token, one sequence at a time."""
    model.eval()
    out = [torch.log_softmax(model(input_ids=row[None].to(model.device), use_cache=False).logits[0, :-1].float(), -1)
           .cpu() for row in sequences]  # fmt: skip
    return torch.stack(out)


@torch.no_grad()
def divergence(model, sequences: torch.Tensor, teacher: torch.Tensor) -> dict[str, float]:
    """Mean per-token KL(teacher || model) and the model's perplexity on ``sequences`` (teacher: its log-probs)."""
    model.eval()
    kl = nll = 0.0
    count = 0
    for row, reference in zip(sequences, teacher, strict=True):
        logprobs = torch.log_softmax(model(input_ids=row[None].to(model.device), use_cache=False).logits[0, :-1]
                                     .float(), -1).cpu()  # fmt: skip
        kl += float((reference.exp() * (reference - logprobs)).sum())
        nll -= float(logprobs.gather(-1, row[1:, None].cpu()).sum())
        count += reference.shape[0]
    return {"kl": kl / count, "perplexity": math.exp(nll / count)}


def swap_kl(model, layers: Iterable[int], entry: dict[str, Any], transferred: Mapping[int, dict],
            original: Mapping[int, dict], sequences: torch.Tensor, teacher: torch.Tensor) -> dict[int, float]:
    """Per layer: the KL of the model's next-token distribution from the original's when only that layer runs its
    transferred variant. Leaves the model as the original (every layer kept)."""
    scores = {}
    for layer in layers:
        apply_layout(model, [layer], entry, transferred, original)
        scores[layer] = divergence(model, sequences, teacher)["kl"]
    apply_layout(model, [], entry, transferred, original)
    return scores


def check_layout(layout: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(layout) - LAYOUT_KEYS)
    if unknown:
        raise ValueError(f"retrofit: {where} has unknown keys {unknown}; a layout takes {sorted(LAYOUT_KEYS)} "
                         "(e.g. {name: selected, keep_full: 7, by: kl} or {name: every4, every: 4}).")
    ways = [key for key in ("keep_full", "every", "keep") if key in layout]
    if len(ways) > 1:
        raise ValueError(f"retrofit: {where} gives {ways}; give one of keep_full, every or keep.")
    if layout.get("by", "kl") not in ("kl", "error"):
        raise ValueError(f"retrofit: {where}: by={layout['by']!r}; use 'kl' (swap KL) or 'error' (transfer error).")
    if "every" in layout and (not isinstance(layout["every"], int) or layout["every"] < 1):
        raise ValueError(f"retrofit: {where}: every={layout['every']!r} must be a positive integer (4: one in 4 kept).")
    if "offset" in layout and ("every" not in layout or not isinstance(layout["offset"], int)
                               or not 0 <= layout["offset"] < layout["every"]):
        raise ValueError(f"retrofit: {where}: offset={layout['offset']!r} goes with every and lies in [0, every) "
                         "(every: 4, offset: 3 keeps layers 3, 7, 11, ...).")
    keep_full = layout.get("keep_full", 0)
    count_ok = isinstance(keep_full, int) and not isinstance(keep_full, bool) and keep_full >= 0
    if not count_ok and not (isinstance(keep_full, float) and 0 <= keep_full < 1):
        raise ValueError(f"retrofit: {where}: keep_full={keep_full!r} must be a count (7) or a fraction in [0, 1).")


def kept_layers(layout: Mapping[str, Any], count: int, kl: Mapping[int, float] | None = None,
                error: Mapping[int, float] | None = None) -> list[int]:
    """The layers ``layout`` keeps as full attention, in order, among ``count`` layers."""
    check_layout(layout, f"layout {layout.get('name', '')!r}")
    if "keep" in layout:
        kept = sorted(int(i) for i in layout["keep"])
        if any(not 0 <= i < count for i in kept):
            raise ValueError(f"retrofit: keep={kept} names layers outside 0..{count - 1}.")
        return kept
    if "every" in layout:
        every = int(layout["every"])
        offset = int(layout.get("offset", every - 1))
        return [i for i in range(count) if i % every == offset]
    keep_full = layout.get("keep_full", 0)
    number = math.floor(keep_full * count + 0.5) if isinstance(keep_full, float) else int(keep_full)
    by = layout.get("by", "kl")
    scores = (kl if by == "kl" else error) or {}
    if number and not scores:
        raise ValueError(f"retrofit: keep_full by {by} needs the {by} of every layer (stage 1 measures them).")
    if number > len(scores):
        raise ValueError(f"retrofit: keep_full={number} is more than the {len(scores)} layers stage 1 converted.")
    ranked = sorted(scores, key=lambda i: -scores[i])  # among the layers stage 1 converted: the others stay full
    return sorted(ranked[:number])
