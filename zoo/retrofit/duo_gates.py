"""Which KV heads need the whole cache, measured two ways on a frozen model (DuoAttention, Xiao et al. 2024,
arXiv 2410.10819):

- :func:`train_gates`: one gate α per (layer, KV head), initialised 1, the only trained parameter. Each attention layer
  gives every query head of KV group ``h`` the mix ``α·full + (1 − α)·streaming`` (streaming: ``sinks`` first keys and
  the ``recent`` last keys, the query included). Loss: MSE between the gated model's final hidden states and the full
  model's on the answer rows + λ·mean|α| (the official code; Σ|α|, the paper's formula, on request); α clamped to
  [0, 1] after each step.
- :func:`needle_mass`: training-free; the attention mass the rows that produce an answer put on that answer's needle,
  per KV head (mean over the group's query heads and the prompts), from those few query rows only.

Both run as transformers attention functions (:data:`GATED`, :data:`PROBE`, registered with
``AttentionInterface.register``) that read what they need from keyword arguments of the model's forward: full attention
is torch SDPA, the streaming branch the ``duo`` variant's own streaming kernel (every head streaming: queries in blocks,
O(n·(sinks + recent))), the one a saved layout runs; no n × n mask or matrix is built.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, masking_utils

from zoo.call import AttentionCall
from zoo.registry import get_variant_class

GATED = "zoo_duo_gated"  # names without "flash" / "sdpa" (each triggers special handling in transformers)
PROBE = "zoo_duo_probe"


@dataclass
class Retrieval:
    """One synthetic prompt: ``ids``; ``loss_rows`` (positions whose final hidden states the gate loss compares);
    per needle, the rows that produce its answer (``answer_rows``) and its token span ``[start, end)`` (``needles``)."""

    ids: list[int]
    loss_rows: list[int]
    answer_rows: list[list[int]]
    needles: list[tuple[int, int]]
    meta: dict = field(default_factory=dict)


class DuoGates(torch.nn.Module):
    """α per (layer, KV head) and the streaming window the gated attention mixes in."""

    def __init__(self, layers: int, kv_heads: int, sinks: int, recent: int, initial: float = 1.0):
        super().__init__()
        if recent < 1 or sinks < 0:
            raise ValueError(f"duo gates: recent={recent} must be >= 1 and sinks={sinks} >= 0.")
        self.alpha = torch.nn.Parameter(torch.full((layers, kv_heads), float(initial)))
        self.sinks, self.recent = sinks, recent
        self.streaming = get_variant_class("duo")(full_heads=[[]], sinks=sinks, recent=recent)  # no head full


def register() -> None:
    """Register both attention functions with the 2-D padding mask function (never an n × n mask)."""
    for name, function in ((GATED, gated_attention), (PROBE, probe_attention)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, masking_utils.flash_attention_mask)


@contextmanager
def attention(model, name: str):
    """Run ``model`` on attention function ``name`` inside the block, then on what it ran before."""
    register()
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def full_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal SDPA with grouped KV heads: (batch, heads, n, dim)."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)


def _full_of_call(query, key, value, attention_mask, scaling) -> tuple[torch.Tensor, float]:
    """(full attention, the scale) of an unpadded call: prompts are scored one at a time."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("duo heads: prompts are scored one at a time without padding; got a padded batch.")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return full_attention(query, key, value, scaling), scaling


def streaming_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                        gates: DuoGates) -> torch.Tensor:
    """Each query over the ``sinks`` first keys and the ``recent`` last ones (itself included), grouped KV heads as
    they are. (batch, heads, n, dim)."""
    return gates.streaming.attend(query, key, value, AttentionCall(causal=True, scaling=scaling))


def gated_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                    duo_gates: DuoGates | None = None, **kwargs):
    """``α·full + (1 − α)·streaming`` per KV group, α of ``module.layer_idx`` (all 1 without ``duo_gates``)."""
    out, scaling = _full_of_call(query, key, value, attention_mask, scaling)
    if duo_gates is not None:
        alpha = duo_gates.alpha[module.layer_idx].repeat_interleave(query.shape[1] // key.shape[1])[:, None, None]
        out = alpha * out + (1 - alpha) * streaming_attention(query, key, value, scaling, duo_gates)
    return out.transpose(1, 2).contiguous(), None


@dataclass
class Probe:
    """What :func:`probe_attention` measures: for rows ``rows`` (r,), the mass on the keys ``targets`` (r, n) bool;
    ``mass[layer]`` holds the per-KV-head mean over the rows."""

    rows: torch.Tensor
    targets: torch.Tensor
    mass: dict = field(default_factory=dict)


def probe_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                    duo_probe: Probe | None = None, **kwargs):
    """Full attention; with ``duo_probe``, also the softmax of its few query rows (r × n, never n × n)."""
    out, scaling = _full_of_call(query, key, value, attention_mask, scaling)
    if duo_probe is not None:
        groups = query.shape[1] // key.shape[1]
        rows = duo_probe.rows.to(query.device)
        logits = query[:, :, rows] @ key.repeat_interleave(groups, 1).transpose(-1, -2) * scaling  # (b, H, r, n)
        later = torch.arange(key.shape[-2], device=query.device)[None, :] > rows[:, None]
        weights = torch.softmax(logits.float().masked_fill(later, float("-inf")), -1)
        mass = (weights * duo_probe.targets.to(weights.device)).sum(-1).mean((0, 2))  # (H,)
        per_kv = mass.view(key.shape[1], groups).mean(1)
        duo_probe.mass[module.layer_idx] = duo_probe.mass.get(module.layer_idx, 0) + per_kv.cpu()
    return out.transpose(1, 2).contiguous(), None


def shape_of(model) -> tuple[int, int]:
    """(layers, KV heads) of a decoder's config."""
    config = model.config
    return int(config.num_hidden_layers), int(getattr(config, "num_key_value_heads", config.num_attention_heads))


@torch.no_grad()
def needle_mass(model, prompts: list[Retrieval]) -> torch.Tensor:
    """(layers, KV heads): mean over prompts and needles of the attention mass the rows producing a needle's answer
    put on that needle's tokens."""
    model.eval()
    layers, kv_heads = shape_of(model)
    total = torch.zeros(layers, kv_heads)
    with attention(model, PROBE):
        for prompt in prompts:
            rows, targets = [], []
            for answer_rows, (start, end) in zip(prompt.answer_rows, prompt.needles, strict=True):
                row_target = torch.zeros(len(prompt.ids), dtype=torch.bool)
                row_target[start:end] = True
                rows += answer_rows
                targets += [row_target] * len(answer_rows)
            probe = Probe(torch.tensor(rows), torch.stack(targets))
            model.model(input_ids=torch.tensor([prompt.ids], device=model.device), use_cache=False, duo_probe=probe)
            total += torch.stack([probe.mass[i] for i in range(layers)])
    return total / max(1, len(prompts))


@dataclass
class GateSettings:
    """DuoAttention's optimisation (the official scripts' values: AdamW lr 0.02, λ = 0.05, α from 1). The penalty is
    λ times the mean of |α| over every gate, as the official code's ``l1_loss``; ``reg_reduction="sum"`` takes Σ|α|
    as the paper writes it (N gates times stronger)."""

    steps: int = 100
    learning_rate: float = 0.02
    reg_weight: float = 0.05
    reg_reduction: str = "mean"
    initial: float = 1.0
    seed: int = 0


def schedule(steps: int):
    """The official LR multiplier: linear warm-up over the first fifth from 0.1, flat, linear cool-down to 0.1."""
    fifth = max(1, steps // 5)
    return lambda step: min(1.0, max((step + 1) / fifth, 0.1), max((steps - step) / fifth, 0.1))


@torch.no_grad()
def teacher_states(model, prompts: list[Retrieval]) -> list[torch.Tensor]:
    """The full model's final hidden states on each prompt's loss rows (computed once: the model is frozen)."""
    return [model.model(input_ids=torch.tensor([p.ids], device=model.device), use_cache=False)
            .last_hidden_state[0, p.loss_rows].float() for p in prompts]  # fmt: skip


def train_gates(model, prompts: list[Retrieval], settings: GateSettings, sinks: int, recent: int,
                log=None) -> dict:
    """Train the gates on ``prompts`` (cycled, one per step). Returns ``{"alpha": (layers, KV heads), "mean_alpha": α
    averaged over the steps, "history": per-step rows, "seconds": ...}``. The model's weights stay frozen."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    started = time.perf_counter()
    teachers = teacher_states(model, prompts)
    teacher_seconds = time.perf_counter() - started
    gates = DuoGates(*shape_of(model), sinks=sinks, recent=recent, initial=settings.initial).to(model.device)
    optimizer = torch.optim.AdamW([gates.alpha], lr=settings.learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(settings.steps))
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(settings.seed)).tolist()
    history, running = [], torch.zeros_like(gates.alpha)
    with attention(model, GATED):
        for step in range(settings.steps):
            tick = time.perf_counter()
            index = order[step % len(order)]
            prompt = prompts[index]
            hidden = model.model(input_ids=torch.tensor([prompt.ids], device=model.device), use_cache=False,
                                 duo_gates=gates).last_hidden_state[0, prompt.loss_rows].float()
            distill = (hidden - teachers[index]).pow(2).mean(-1).mean()
            regular = gates.alpha.abs().sum() if settings.reg_reduction == "sum" else gates.alpha.abs().mean()
            loss = distill + settings.reg_weight * regular
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                gates.alpha.clamp_(0.0, 1.0)
                running += gates.alpha
            row = {"step": step + 1, "distill": distill.item(), "l1": regular.item(), "loss": loss.item(),
                   "mean_alpha": gates.alpha.mean().item(), "tokens": len(prompt.ids),
                   "seconds": time.perf_counter() - tick}
            history.append(row)
            if log is not None:
                log(row)
    return {"alpha": gates.alpha.detach().cpu().clone(), "mean_alpha": (running / max(1, settings.steps)).cpu(),
            "history": history, "teacher_seconds": teacher_seconds, "seconds": time.perf_counter() - started}


@torch.no_grad()
def swap_kl(model, sequences: torch.Tensor, teacher: torch.Tensor, sinks: int, recent: int,
            divergence) -> torch.Tensor:
    """(layers, KV heads): the held-out next-token KL from the original when only that one KV head is streaming
    (α = 0 there, 1 elsewhere). ``divergence(model, sequences, teacher)`` is the retrofit's KL measure."""
    layers, kv_heads = shape_of(model)
    scores = torch.zeros(layers, kv_heads)
    with attention(model, GATED):
        for layer in range(layers):
            for head in range(kv_heads):
                gates = DuoGates(layers, kv_heads, sinks, recent).to(model.device)
                gates.alpha[layer, head] = 0.0
                scores[layer, head] = divergence(with_kwargs(model, duo_gates=gates), sequences, teacher)["kl"]
    return scores


class with_kwargs:  # noqa: N801  (used as a function)
    """``model`` called with extra keyword arguments (what :func:`divergence` calls is ``model(input_ids=...)``)."""

    def __init__(self, model, **kwargs):
        self.model, self.kwargs = model, kwargs
        self.device = model.device

    def eval(self):
        self.model.eval()
        return self

    def __call__(self, **inputs):
        return self.model(**inputs, **self.kwargs)
