"""Stage 1, attention transfer (LoLCATs, Zhang et al. 2024): each converted layer's attention module, now running the
variant on its own (frozen) q/k/v projections, is trained to reproduce that layer's original output on the same
inputs (:mod:`zoo.retrofit.capture`). Only the variant's learned weights (``<attention>.attention_zoo``) train, plus
LoRA adapters on the q/k/v projections when asked (peft, merged into the projections afterwards). Layers are
independent: each trains from the original model's activations, so the order does not matter.

The loss and the reported error are the same number: the mean squared error over the teacher output's variance
(:func:`normalized_error`; 1.0 is what predicting the mean output scores, 0 is exact). The comparison is on the
module's output (after the output projection: what the residual stream receives).

A variant with a stage of its own (:meth:`zoo.variant.Variant.transfer_stage`, :class:`OwnStage`; DSA's dense
warm-up) trains with the stage's parameters by its weights' auxiliary loss, reported before and after on the held-out
rows (:func:`held_out_auxiliary`); the error before and after is still that of the layer as configured (sparse DSA).

``transfer.loss: attention`` (:attr:`TransferSettings.loss`) trains by Hedgehog's loss instead (Zhang et al. 2024, the
loss LoLCATs' stage 1 weighs against the output MSE): the cross-entropy of the variant's attention distribution
(:meth:`zoo.variant.Variant.attention_weights`) against the original softmax attention's, both from the q and k the
layer's frozen projections and rotary embedding give on the captured inputs (:func:`attention_loss`). The error
reported before and after stays the output error, so runs with either loss compare; the held-out cross-entropy before
and after joins the layer's row and the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import get_cosine_schedule_with_warmup

from zoo.call import AttentionCall
from zoo.ops import allowed_mask, expand_kv, safe_softmax
from zoo.ops.state import state_dtype
from zoo.plug.spec import variant_for
from zoo.plug.weights import WEIGHTS_NAME
from zoo.retrofit.capture import Captured
from zoo.variant import Variant, auxiliary_losses
from zoo.variants.hybrid import HybridAttention

logger = logging.getLogger("zoo.retrofit")

# The input projections of the attention modules of the families the zoo supports (Llama, Qwen2, Mistral: q/k/v_proj;
# GPT-2: the fused c_attn; BERT: query/key/value; Phi-3: qkv_proj; ModernBERT: Wqkv).
PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "c_attn", "query", "key", "value", "qkv_proj", "Wqkv")
LOSSES = ("output", "attention")  # transfer.loss: the normalized output error, or Hedgehog's attention cross-entropy


@dataclass
class TransferSettings:
    """How one layer is trained: ``steps`` Adam steps of ``batch`` captured sequences, cosine schedule with 10 %
    warm-up; ``lora``: ``{r, alpha, targets}`` adapters on the input projections (None: the variant's weights only);
    ``loss``: what trains them, ``output`` (:func:`normalized_error`) or ``attention`` (:func:`attention_loss`)."""

    steps: int = 100
    learning_rate: float = 1e-3
    batch: int = 2
    lora: dict | None = None
    seed: int = 0
    eval_batch: int = 1
    loss: str = "output"


@dataclass
class OwnStage:
    """A variant's own stage 1 for :func:`train_layer`: ``measure``, the auxiliary loss it trains by; ``use(True)``
    runs the converted layers with the stage's parameters, ``use(False)`` with the configured ones."""

    measure: str
    use: Callable[[bool], None]


def loss_problem(loss: str, lora: dict | None, variant: Variant | None) -> str | None:
    """Why ``transfer.loss`` cannot train ``variant`` (with ``lora``), as a sentence naming the key and the fix; None
    when it can."""
    if loss not in LOSSES:
        return f"transfer.loss: {loss!r} is not one of {', '.join(LOSSES)}."
    if loss != "attention":
        return None
    if lora:
        return ("transfer.loss: attention holds the variant's attention weights to those of the layer's frozen q/k "
                "projections, which LoRA (transfer.lora) would move; drop transfer.lora (stage 2 can take lora) or "
                "use transfer.loss: output.")
    if variant is not None and not variant.overrides("attention_weights"):
        return (f"transfer.loss: attention trains the layer toward softmax's attention weights, but variant "
                f"{variant.name!r} offers none (Variant.attention_weights); use transfer.loss: output (the default), "
                "or a variant that offers them (linear, e.g. with feature_map: hedgehog).")
    return None


def normalized_error(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the teacher's variance (all elements): scale-free, 1.0 for the mean's prediction."""
    teacher = teacher.float()
    return (student.float() - teacher).pow(2).mean() / teacher.var(correction=0).clamp_min(1e-12)


@torch.no_grad()
def held_out_error(module: torch.nn.Module, captured: Captured, layer: int, rows: Sequence[int],
                   batch: int = 1) -> float:
    """:func:`normalized_error` of ``module`` on the captured ``rows``, pooled over all of them."""
    module.eval()
    squared = total = total_sq = 0.0
    count = 0
    for start in range(0, len(rows), batch):
        inputs, teacher = captured.batch(layer, rows[start : start + batch])
        student = captured.call(module, layer, inputs).float().cpu()
        squared += float((student - teacher).pow(2).sum())
        total += float(teacher.sum())
        total_sq += float(teacher.pow(2).sum())
        count += teacher.numel()
    variance = total_sq / count - (total / count) ** 2
    return squared / count / max(variance, 1e-12)


def softmax_weights(q: torch.Tensor, k: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """The original layer's attention distribution (B, H, Nq, N): softmax of q·k times the model's ``call.scaling``
    over the keys causality and padding allow (grouped keys repeated per query head, as the model does), in the
    compute dtype (fp32, fp64 for fp64)."""
    dtype = state_dtype(q)
    if k.shape[1] != q.shape[1]:
        k, _ = expand_kv(k, k, q.shape[1])
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * call.scaling
    allowed = allowed_mask(call, None, q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return safe_softmax(scores)


def attention_cross_entropy(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """−Σ_j p_j log s_j per query (teacher p, student s over the same keys), averaged over the queries that see a key;
    its floor is the teacher's entropy (the KL to it is this minus that)."""
    seen = teacher.sum(dim=-1) > 0
    per_query = -(teacher * student.to(teacher.dtype).clamp_min(1e-12).log()).sum(dim=-1)
    return per_query[seen].mean()


@contextmanager
def recorded_calls(module: torch.nn.Module) -> Iterator[list]:
    """Inside, a forward of ``module`` records what its variant's kernel is handed, ``(variant, q, k, call)`` (q and k
    as the host made them: projected, rotated; for a ``hybrid``, the layer's own variant), and skips the kernel: the
    module's output is meaningless there."""
    variant = variant_for(module.config)
    parts = variant.parts if isinstance(variant, HybridAttention) else [variant]
    seen: list = []

    def recorder(part: Variant):
        def attend(q, k, v, call):
            seen.append((part, q, k, call))
            return q.new_zeros(*q.shape[:-1], v.shape[-1])

        return attend

    for part in parts:
        part.attend = recorder(part)
    try:
        yield seen
    finally:
        for part in parts:
            vars(part).pop("attend", None)


def attention_loss(module: torch.nn.Module, captured: Captured, layer: int, inputs: torch.Tensor) -> torch.Tensor:
    """:func:`attention_cross_entropy` of ``module``'s variant's attention distribution against softmax's, from
    the q and k of one forward on ``inputs`` (the captured hidden states of ``layer``)."""
    with recorded_calls(module) as seen:
        captured.call(module, layer, inputs)
    if len(seen) != 1:
        raise ValueError(f"retrofit: transfer.loss: attention expected one attention call of layer {layer}'s variant "
                         f"in its forward, got {len(seen)}.")
    variant, q, k, call = seen[0]
    student = variant.attention_weights(q, k, call)
    if student is None:
        raise ValueError("retrofit: " + (loss_problem("attention", None, variant) or (
            f"transfer.loss: attention: variant {variant.name!r} offers no attention weights at these parameters "
            "(Variant.attention_weights returned None); use transfer.loss: output.")))
    with torch.no_grad():
        teacher = softmax_weights(q.detach(), k.detach(), call)
    return attention_cross_entropy(student, teacher)


@torch.no_grad()
def held_out_attention_loss(module: torch.nn.Module, captured: Captured, layer: int, rows: Sequence[int],
                            batch: int = 1) -> float:
    """The mean over ``rows`` of :func:`attention_loss` (eval mode)."""
    module.eval()
    total = 0.0
    for start in range(0, len(rows), batch):
        chosen = rows[start : start + batch]
        total += float(attention_loss(module, captured, layer, captured.batch(layer, chosen)[0])) * len(chosen)
    return total / len(rows)


def held_out_auxiliary(
    module: torch.nn.Module, captured: Captured, layer: int, rows: Sequence[int], name: str, batch: int = 1
) -> float:
    """The mean over ``rows`` of the auxiliary loss ``name`` of ``module``'s variant weights, from training forwards
    (gradients on, no step; the graphs are dropped)."""
    weights = module._modules[WEIGHTS_NAME]
    flags = [p.requires_grad for p in weights.parameters()]
    weights.requires_grad_(True)
    module.train()
    total = 0.0
    try:
        for start in range(0, len(rows), batch):
            chosen = rows[start : start + batch]
            with torch.enable_grad():
                captured.call(module, layer, captured.batch(layer, chosen)[0])
            losses = auxiliary_losses(module, reset=True)
            if name not in losses:
                raise ValueError(
                    f"retrofit: layer {layer}'s variant weights computed no {name!r} in a training "
                    f"forward (they computed {sorted(losses) or 'none'})."
                )
            total += float(losses[name]) * len(chosen)
    finally:
        for parameter, flag in zip(weights.parameters(), flags, strict=True):
            parameter.requires_grad_(flag)
        module.eval()
    return total / len(rows)


def projection_names(module: torch.nn.Module, wanted: Sequence[str] | None = None) -> list[str]:
    """The input projections of ``module`` LoRA adapts: ``wanted`` (checked), else those of :data:`PROJECTION_NAMES`."""
    children = dict(module.named_children())
    if wanted:
        unknown = sorted(set(wanted) - set(children))
        if unknown:
            raise ValueError(f"retrofit: transfer.lora.targets {unknown} are not submodules of "
                             f"{type(module).__name__}; its submodules: {', '.join(children)}.")
        return list(wanted)
    found = [name for name in PROJECTION_NAMES if name in children]
    if not found:
        raise ValueError(f"retrofit: no q/k/v projection found in {type(module).__name__} (submodules: "
                         f"{', '.join(children)}); name them in transfer.lora.targets.")
    return found


def variant_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    weights = module._modules.get(WEIGHTS_NAME)
    return list(weights.parameters()) if weights is not None else []


def with_lora(module: torch.nn.Module, lora: dict):
    """Wrap ``module``'s input projections with LoRA adapters (peft's ``LoraModel`` on the module itself); returns the
    tuner, whose ``merge_and_unload()`` folds them back into plain projections."""
    import peft

    config = peft.LoraConfig(r=int(lora.get("r", 8)), lora_alpha=float(lora.get("alpha", 2 * int(lora.get("r", 8)))),
                             target_modules=projection_names(module, lora.get("targets")), lora_dropout=0.0)
    return peft.LoraModel(module, config, "default")


def train_layer(
    module: torch.nn.Module,
    captured: Captured,
    layer: int,
    train_rows: Sequence[int],
    held_out_rows: Sequence[int],
    settings: TransferSettings,
    stage: OwnStage | None = None,
) -> dict:
    """Train one converted attention module to reproduce its layer's captured outputs (``stage``: by the variant's
    own stage); returns the layer's line of the transfer map (held-out error before and after, with a stage its
    measure before and after, parameters trained, steps, tokens, seconds)."""
    started = time.perf_counter()
    before = held_out_error(module, captured, layer, held_out_rows, settings.eval_batch)
    measured = {}
    attention = settings.loss == "attention"  # with a stage of the variant's own: refused by the config
    if attention:
        measured["attention_loss_before"] = held_out_attention_loss(
            module, captured, layer, held_out_rows, settings.eval_batch
        )
    if stage is not None:
        stage.use(True)
        measured |= {
            "measure": stage.measure,
            "measure_before": held_out_auxiliary(
                module, captured, layer, held_out_rows, stage.measure, settings.eval_batch
            ),
        }
    count, steps = fit(module, captured, layer, train_rows, settings)
    if stage is not None:
        measured["measure_after"] = measured["measure_before"]
        if steps:
            measured["measure_after"] = held_out_auxiliary(
                module, captured, layer, held_out_rows, stage.measure, settings.eval_batch
            )
        stage.use(False)
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    after = held_out_error(module, captured, layer, held_out_rows, settings.eval_batch) if steps else before
    if attention:
        measured["attention_loss_after"] = measured["attention_loss_before"]
        if steps:
            measured["attention_loss_after"] = held_out_attention_loss(
                module, captured, layer, held_out_rows, settings.eval_batch
            )
        logger.info("retrofit: layer %d attention cross-entropy %.4f -> %.4f (held out)", layer,
                    measured["attention_loss_before"], measured["attention_loss_after"])
    return {
        "layer": layer,
        "error_before": before,
        "error_after": after,
        **measured,
        "trained_parameters": count,
        "steps": steps,
        "tokens": steps * settings.batch * captured.length,
        "seconds": time.perf_counter() - started,
    }


def fit(
    module: torch.nn.Module, captured: Captured, layer: int, train_rows: Sequence[int], settings: TransferSettings
) -> tuple[int, int]:
    """The training loop of :func:`train_layer` (LoRA merged at the end); returns (parameters trained, steps)."""
    problem = loss_problem(settings.loss, settings.lora, None)
    if problem:
        raise ValueError(f"retrofit: {problem}")
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    tuner = with_lora(module, settings.lora) if settings.lora else None
    trained = variant_parameters(module) + [p for n, p in module.named_parameters() if "lora_" in n]
    steps = settings.steps if trained and settings.steps > 0 else 0
    if steps:
        for parameter in trained:
            parameter.requires_grad_(True)
        optimizer = torch.optim.AdamW(trained, lr=settings.learning_rate, weight_decay=0.0)
        schedule = get_cosine_schedule_with_warmup(optimizer, max(1, steps // 10), steps)
        generator = torch.Generator().manual_seed(settings.seed * 100_003 + layer)
        module.train()
        for _ in range(steps):
            pick = torch.randint(len(train_rows), (settings.batch,), generator=generator).tolist()
            inputs, teacher = captured.batch(layer, [train_rows[i] for i in pick])
            if settings.loss == "attention":
                loss = attention_loss(module, captured, layer, inputs)
            else:
                student = captured.call(module, layer, inputs)
                loss = normalized_error(student, teacher.to(student.device))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        module.eval()
    count = sum(p.numel() for p in trained)
    if tuner is not None:
        tuner.merge_and_unload()
    return count, steps
