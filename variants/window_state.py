"""``window_state``: a sliding window of exact softmax and a recurrent state in one layer (LoLCATs, Zhang et al. 2024;
Liger, Lan et al. 2025), causal only.

Query i reads the keys j with i − W < j ≤ i (``window``, its own included) by softmax, plus the first ``sinks`` real
tokens of its row once they are older than the window, and every other earlier key through the ``state`` variant's
recurrence, run over the keys in the order they leave the window (the state after the keys j ≤ i − W; a sink never
enters it). ``state`` is ``linear`` (any feature map, Hedgehog's included), ``based``, ``gla``, ``deltanet`` or
``gated_deltanet``, with its own parameters and learned weights. The two parts meet by ``combine``:

* ``"shared"`` (LoLCATs): one normalizer over both, with the window's scores shifted by their maximum m_i,

      y_i = (γ_h Σ_win e^{s_ij − m_i} v_j + Σ_{j ≤ i−W} φ(q_i)·φ(k_j) v_j)
            / (γ_h Σ_win e^{s_ij − m_i} + Σ_{j ≤ i−W} φ(q_i)·φ(k_j)),

  s_ij the model's scaled score, γ_h = sigmoid(a learned logit per head), started at −2.1972 (γ = 0.1, LoLCATs'
  configs), the linear weight 1 (LoLCATs' default, ``affine_attention_factors`` off). Needs a state with a positive
  feature map and a normalizer (``linear``, ``based``); the gated and delta-rule states have neither and are refused.
* ``"mix"`` (Liger's hybrid): y_i = μ_h · softmax-window output + (1 − μ_h) · the state's own output, μ_h =
  sigmoid(a learned logit per head) started at 0 (equal halves). Any of the five states. Liger's gated state reads
  every key, this one the keys that left the window only (so no key is counted twice).

Kernel: the window by query blocks (:func:`zoo.ops.window_state.window_softmax_parts`, tiles of C × (W + C − 1)
scores), the state by the state variant's own chunkwise kernel on its per-token inputs delayed by W tokens
(:func:`zoo.ops.window_state.shifted`): never an n × n tensor. :meth:`reference` is the dense masked softmax plus the
state's dense form (feature maps) or its token-by-token recurrence (tests only).

Decoding (:class:`zoo.cache.WindowStateLayer`): a ring of the last W keys and values, with what the state variant
derived from each when it arrived (feature-mapped key, gates), the sinks, and the state; a token leaving the ring
enters the state. Bytes bounded by W and the state, whatever the context; no rollback.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from zoo.variants.based import BasedAttention
from zoo.variants.deltanet import DeltaNetAttention
from zoo.variants.gla import GLAAttention
from zoo.variants.linear import LinearAttention

from zoo.cache import WindowStateLayer
from zoo.modules import normalized
from zoo.ops import allowed_mask
from zoo.ops.delta_rule import delta_rule
from zoo.ops.delta_rule.naive import delta_rule_recurrence
from zoo.ops.gated_linear import gated_linear_attention, gated_linear_flops
from zoo.ops.gated_linear.naive import gated_linear_recurrence
from zoo.ops.state import autocast_off, carried, state_dtype
from zoo.ops.streaming import gather_sinks, sink_positions
from zoo.ops.window_state import shifted, window_softmax_parts
from zoo.registry import UnknownVariantError, get_variant_class
from zoo.variant import AttentionCall, LayerWeights, Param, Variant, VariantParameterError

SHARED_INIT = -2.1972245773362196  # LoLCATs: sigmoid = 0.1 of the window beside the linear part's 1
MIX_INIT = 0.0  # Liger: equal halves
STATES = "linear, based, gla, deltanet or gated_deltanet"
HEDGEHOG = {"variant": "linear", "params": {"feature_map": "hedgehog"}}
EXAMPLE = "state={'variant': 'linear', 'params': {'feature_map': 'hedgehog'}}"


class WindowStateWeights(LayerWeights):
    """The window's weight per head (a logit) and the state variant's own learned weights (``state``)."""

    def __init__(self, heads: int, init: float, state: nn.Module | None) -> None:
        super().__init__()
        self.factor = nn.Parameter(torch.full((heads,), float(init)))
        self.state = state
        self.needs_hidden_states = bool(getattr(state, "needs_hidden_states", False))

    def initialize_from(self, attention: nn.Module) -> None:
        if isinstance(self.state, LayerWeights):
            self.state.initialize_from(attention)


class StateRule:
    """How a family of state variants turns a call's tokens into its inputs, and runs its kernel on them."""

    normalized = False  # a positive feature map and a denominator: the outputs come as (numerator, denominator)

    def inputs(self, part: Variant, q, k, v, call: AttentionCall, conv: dict | None):
        """(the queries' side, {name: (B, H, n, ...) per-token tensor}); zeros write nothing into the state."""
        raise NotImplementedError

    def run(self, part: Variant, query, tokens: dict, call: AttentionCall, state: dict | None):
        raise NotImplementedError

    def recurrence(self, part: Variant, query, tokens: dict, call: AttentionCall):
        """The same as :meth:`run` without a state, token by token (tests only)."""
        raise NotImplementedError


class FeatureRule(StateRule):
    """``linear`` / ``based``: Σ φ(k)[v, 1]ᵀ, an unnormalized linear state with a ones column for the denominator."""

    normalized = True

    def inputs(self, part, q, k, v, call, conv):
        phi_q, phi_k, v = part.features(q, k, v, call, conv)
        return phi_q, {"k": phi_k, "v": v}

    def _args(self, query, tokens):
        values = F.pad(tokens["v"], (0, 1), value=1.0)
        no_decay = query.new_zeros(query.shape[:3])
        return query, tokens["k"], values, no_decay

    def _split(self, out):
        return out[..., :-1], out[..., -1:]

    def run(self, part, query, tokens, call, state):
        if state is not None and query.shape[2] == 1 and "linear" in state:  # a decoding step: S += φ(k)ᵀ[v, 1]
            summed = state["linear"]
            keys = tokens["k"].to(summed.dtype).transpose(-1, -2)
            values = F.pad(tokens["v"].to(summed.dtype), (0, 1), value=1.0)
            if summed.requires_grad:  # made by a call under autograd, which may have saved it for its backward
                state["linear"] = summed = summed + keys @ values
            else:  # added in place, as the ring is written (one fused product, no new state tensor a step)
                summed.view(-1, *summed.shape[-2:]).baddbmm_(keys.reshape(-1, keys.shape[-2], 1),
                                                             values.reshape(-1, 1, values.shape[-1]))
            return self._split(query.to(summed.dtype) @ summed)
        return self._split(carried(gated_linear_attention, state, "linear", *self._args(query, tokens), 1.0))

    def recurrence(self, part, query, tokens, call):
        return self._split(gated_linear_recurrence(*self._args(query, tokens), 1.0)[0])


class GatedRule(StateRule):
    """``gla``: its prepared q, k, v and log α."""

    def inputs(self, part, q, k, v, call, conv):
        q, k, v, log_decay = part.prepare(q, k, v, call, conv)
        return q, {"k": k, "v": v, "log_decay": log_decay}

    def run(self, part, query, tokens, call, state):
        out = carried(gated_linear_attention, state, "gla", query, tokens["k"], tokens["v"], tokens["log_decay"],
                      query.shape[-1] ** -0.5, part.chunk_size)
        return normalized(call.weights, out)

    def recurrence(self, part, query, tokens, call):
        out = gated_linear_recurrence(query, tokens["k"], tokens["v"], tokens["log_decay"], query.shape[-1] ** -0.5)
        return normalized(call.weights, out[0])


class DeltaRule(StateRule):
    """``deltanet`` / ``gated_deltanet``: its prepared q, k, v, β and log α (None without a decay)."""

    def inputs(self, part, q, k, v, call, conv):
        q, k, v, beta, log_decay = part.prepare(q, k, v, call, conv)
        tokens = {"k": k, "v": v, "beta": beta}
        if log_decay is not None:
            tokens["log_decay"] = log_decay
        return q, tokens

    def _args(self, query, tokens):
        return query, tokens["k"], tokens["v"], tokens["beta"], tokens.get("log_decay"), query.shape[-1] ** -0.5

    def run(self, part, query, tokens, call, state):
        return normalized(call.weights, carried(delta_rule, state, "delta", *self._args(query, tokens),
                                                part.chunk_size))

    def recurrence(self, part, query, tokens, call):
        return normalized(call.weights, delta_rule_recurrence(*self._args(query, tokens))[0])


RULES: tuple[tuple[type, StateRule], ...] = (
    (LinearAttention, FeatureRule()), (BasedAttention, FeatureRule()), (GLAAttention, GatedRule()),
    (DeltaNetAttention, DeltaRule()),
)


class WindowStateAttention(Variant):
    name = "window_state"
    exact = False  # softmax in the window, a recurrence beyond: held to its own reference
    supports_bidirectional = False
    supports_dropout = False
    time_complexity = "O(n·W·d) + the state's O(n·C·d + n·d²)"
    memory_complexity = "O(n·(W + C)) + the state's O(n·C·d)"
    error_bound = 1e-4  # relative error vs ``reference`` (fp32 rounding of two kernels)
    params = {
        "window": Param(64, int, "keys each query reads by softmax, its own included (LoLCATs: 64)", min=1),
        "sinks": Param(0, int, "first real tokens of each row that every query also reads by softmax", min=0),
        "state": Param(HEDGEHOG, (str, dict), f"the recurrent variant over the keys that left the window: {STATES}, "
                       "as a name or {variant, params} (default: linear with Hedgehog feature maps, LoLCATs')"),
        "combine": Param("shared", str, "'shared': one normalizer (LoLCATs; linear or based states); 'mix': a "
                         "learned per-head mix of the two outputs (Liger)", choices=("shared", "mix")),
        "factor_init": Param(None, float, "initial logit of the window's weight per head (None: -2.1972 shared, "
                             "0 mix)", optional=True),
    }
    test_params = {"window": 8, "sinks": 2, "state": {"variant": "linear", "params": {"chunk_size": 16}}}

    def check_config(self) -> None:
        entry = {"variant": self.state} if isinstance(self.state, str) else copy.deepcopy(self.state)
        if not isinstance(entry.get("variant"), str) or set(entry) - {"variant", "params"} or not isinstance(
                entry.get("params") or {}, dict):
            raise VariantParameterError(f"attention-zoo variant 'window_state': parameter 'state' = {self.state!r} "
                                        f"must be a variant name or {{'variant': name, 'params': {{...}}}}, e.g. "
                                        f"{EXAMPLE}.")
        entry["params"] = dict(entry.get("params") or {})
        self.config.update(state=entry)  # normalised, as saved in config.json
        try:
            cls = get_variant_class(entry["variant"])
        except UnknownVariantError as exc:
            raise VariantParameterError(f"attention-zoo variant 'window_state': parameter 'state': {exc}") from exc
        rule = next((rule for base, rule in RULES if issubclass(cls, base)), None)
        if rule is None:
            raise VariantParameterError(
                f"attention-zoo variant 'window_state': parameter 'state' = {entry['variant']!r} is not a recurrent "
                f"variant the window can hand the keys it drops to; use {STATES}.")
        if self.combine == "shared" and not rule.normalized:
            raise VariantParameterError(
                f"attention-zoo variant 'window_state': combine='shared' divides by one normalizer, which needs a "
                f"positive feature map and a denominator, and state {entry['variant']!r} has neither; use "
                "combine='mix' (Liger), or state 'linear' / 'based'.")
        try:
            self.part = cls(**entry["params"])
        except VariantParameterError as exc:
            raise VariantParameterError(f"attention-zoo variant 'window_state', parameter 'state': {exc}") from exc
        self.rule = rule

    def check_model(self, config: Any) -> None:
        positions = getattr(config, "max_position_embeddings", None)
        if positions is not None and self.window + self.sinks > positions:
            raise VariantParameterError(
                f"attention-zoo variant 'window_state': window + sinks = {self.window + self.sinks} exceeds the "
                f"model's max_position_embeddings={positions}; lower 'window' (the state would never be read).")

    def initial_factor(self) -> float:
        if self.factor_init is not None:
            return self.factor_init
        return SHARED_INIT if self.combine == "shared" else MIX_INIT

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> WindowStateWeights:
        if layer_idx == 0:
            self.check_model(config)
        state = self.part.make_module(layer_idx, config, head_dim, num_heads)
        return WindowStateWeights(num_heads, self.initial_factor(), state)

    def cache_layer(self, layer_idx: int, config) -> WindowStateLayer:
        return WindowStateLayer(self.window, self.sinks)

    # ---------------------------------------------------------------------------------------------------

    def _state_inputs(self, q, k, v, call: AttentionCall, conv: dict | None):
        """The state variant's queries and per-token tensors, zeroed where a token never enters the state (padding,
        sinks); plus the part's call and the sinks' positions (B, S), None without sinks."""
        query, tokens, part_call = self._part_inputs(q, k, v, call, conv)
        batch, n = q.shape[0], k.shape[-2]
        end = call.cache.seen if isinstance(call.cache, WindowStateLayer) else n
        sinks = sink_positions(call.row_start, batch, self.sinks, q.device) if self.sinks else None
        enters = call.padding_mask  # (B, n) or None: every token enters
        if self.sinks:
            positions = torch.arange(end - n, end, device=q.device)
            enters_past_sinks = ~(positions[None, None, :] == sinks[:, :, None]).any(dim=1)
            enters = enters_past_sinks if enters is None else enters & enters_past_sinks
        if enters is not None:
            tokens = {name: _where_entering(tensor, enters) for name, tensor in tokens.items()}
        return query, tokens, part_call, sinks

    def _part_inputs(self, q, k, v, call: AttentionCall, conv: dict | None):
        """The state variant's queries and per-token tensors of every token given, and the part's call."""
        weights = self.layer_weights(call)
        if weights.state is not None:
            weights.state.hidden_states = weights.hidden_states
        part_call = dataclasses.replace(call, weights=weights.state, cache=None)
        with autocast_off(q.device.type):
            query, tokens = self.rule.inputs(self.part, q, k, v, part_call, conv)
        return query, tokens, part_call

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        layer = call.cache if isinstance(call.cache, WindowStateLayer) else None
        if layer is None and q.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"attention-zoo variant 'window_state': {q.shape[-2]} queries over {k.shape[-2]} keys without its "
                "own cache; it decodes through zoo.cache.WindowStateLayer (generate's default once the model is "
                "configured with zoo), not a transformers cache of every key.")
        if layer is not None and self._steps_in_place(q, k, v, call, layer):
            return self._step(q, k, v, call, layer).to(v.dtype)
        dtype, n = v.dtype, q.shape[-2]
        query, tokens, part_call, sink_pos = self._state_inputs(q, k, v, call, layer.state if layer else None)
        new_real = call.padding_mask if call.padding_mask is not None else torch.ones(
            q.shape[0], n, dtype=torch.bool, device=q.device)
        keys, values, real, run = k, v, new_real, tokens
        if layer is not None and layer.held():
            ring_keys, ring_values, ring_real, ring_tokens = layer.ring()
            keys, values = torch.cat([ring_keys, k], dim=-2), torch.cat([ring_values, v], dim=-2)
            real = torch.cat([ring_real, new_real], dim=-1)
            run = {name: torch.cat([ring_tokens[name], tensor], dim=2) for name, tensor in tokens.items()}
        held = keys.shape[-2] - n
        entering = {name: shifted(tensor, self.window - held)[:, :, :n] for name, tensor in run.items()}
        end = layer.seen if layer is not None else n
        sinks = self._sinks(keys, values, sink_pos, end, layer)
        with autocast_off(q.device.type):
            numerator, denominator, _ = window_softmax_parts(q, keys, values, self.window, call.scaling, end,
                                                             None if bool(real.all()) else real, sinks)
            state_out = self.rule.run(self.part, query, entering, part_call, layer.state if layer else None)
            out = self._combine(numerator, denominator, state_out, self.layer_weights(call).factor)
        if layer is not None:
            layer.keep(keys, values, real, run)
            if self.sinks:
                layer.keep_sinks(*sinks[:2], sinks[2] >= 0)
        return out.to(dtype)

    def _steps_in_place(self, q, k, v, call: AttentionCall, layer: WindowStateLayer) -> bool:
        """A decoding step that :meth:`_step` takes: one new real token, a ring full of real ones, no sinks to add,
        no gradient through the step (the ring is a buffer written in place: a product that saved it for a backward
        pass would find it changed)."""
        real = call.padding_mask is None or bool(call.padding_mask.all())
        return (k.shape[-2] == 1 and not self.sinks and real and layer.steps_in_place()
                and not (q.requires_grad or k.requires_grad or v.requires_grad))

    def _step(self, q, k, v, call: AttentionCall, layer: WindowStateLayer) -> torch.Tensor:
        """One decoding step without copying the ring: the oldest token goes into the state, the new one takes its
        slot, and the query reads the W tokens held (its whole window, in slot order) and the state."""
        query, tokens, part_call = self._part_inputs(q, k, v, call, layer.state)  # real, no sinks: all enter
        with autocast_off(q.device.type):
            state_out = self.rule.run(self.part, query, layer.oldest(), part_call, layer.state)
            layer.push(k, v, tokens)
            numerator, denominator = _one_query_softmax_parts(q, layer.ring_keys, layer.ring_values, call.scaling)
            return self._combine(numerator, denominator, state_out, self.layer_weights(call).factor)

    def _sinks(self, keys, values, sink_pos, end: int, layer: WindowStateLayer | None):
        """(keys, values, positions (B, S), −1 where a row has none yet): those the layer kept, else in the run."""
        if not self.sinks:
            return None
        found_keys, found_values, found = gather_sinks(keys, values, sink_pos, end - keys.shape[-2])
        if layer is not None and layer.sink_found is not None:
            have = layer.sink_found[:, None, :, None]
            found_keys = torch.where(have, layer.sink_keys, found_keys)
            found_values = torch.where(have, layer.sink_values, found_values)
            found = found | layer.sink_found
        return found_keys, found_values, torch.where(found, sink_pos, torch.full_like(sink_pos, -1))

    def _combine(self, numerator, denominator, state_out, factor: torch.Tensor) -> torch.Tensor:
        weight = torch.sigmoid(factor.to(numerator.dtype))[None, :, None, None]
        tiny = torch.finfo(numerator.dtype).tiny
        if self.combine == "shared":
            state_numerator, state_denominator = state_out
            return (weight * numerator + state_numerator) / (weight * denominator + state_denominator).clamp_min(tiny)
        if self.rule.normalized:
            state_numerator, state_denominator = state_out
            state_out = state_numerator / state_denominator.clamp_min(tiny)
        return weight * numerator / denominator.clamp_min(tiny) + (1 - weight) * state_out.to(numerator.dtype)

    # ---------------------------------------------------------------------------------------------------

    def _dense_masks(self, q, k, call: AttentionCall):
        """(window (B, H, Q, K), beyond (B, H, Q, K)) bool: the keys each query reads by softmax, and by the state."""
        batch, heads, q_len = q.shape[:3]
        kv_len = k.shape[-2]
        allowed = allowed_mask(call, None, batch, heads, q_len, kv_len, q.device)
        allowed = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=q.device) if allowed is None else allowed
        key_pos = torch.arange(kv_len, device=q.device)
        query_pos = key_pos[-q_len:]
        sinks = sink_positions(call.row_start, batch, self.sinks, q.device)
        is_sink = (key_pos[None, None, :] == sinks[:, :, None]).any(dim=1)[:, None, None, :]  # (B, 1, 1, K)
        near = (key_pos[None, :] > query_pos[:, None] - self.window)[None, None]
        window = allowed & (near | is_sink)
        return window, allowed & ~near & ~is_sink

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """The dense masked softmax of the window and the state's dense form (feature maps) or its recurrence on the
        tokens delayed by W (O(n²), tests only)."""
        dtype = state_dtype(q)
        window, beyond = self._dense_masks(q, k, call)
        numerator, denominator = _masked_softmax_parts(q.to(dtype), k.to(dtype), v.to(dtype), window, call.scaling)
        query, tokens, part_call, _ = self._state_inputs(q, k, v, call, None)
        if self.rule.normalized:  # Σ over the keys beyond the window of φ(q)·φ(k), written out
            scores = (query @ tokens["k"].transpose(-1, -2)).masked_fill(~beyond, 0.0)
            state_out = (scores @ tokens["v"], scores.sum(dim=-1, keepdim=True))
        else:
            delayed = {name: shifted(tensor, self.window) for name, tensor in tokens.items()}
            state_out = self.rule.recurrence(self.part, query, delayed, part_call)
        return self._combine(numerator, denominator, state_out, self.layer_weights(call).factor).to(v.dtype)

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        """The (B, H, n, n) distribution over keys of ``combine='shared'`` (what the shared normalizer divides);
        None for ``mix`` (two distributions) or a state without one. O(n²): training losses on short sequences."""
        if self.combine != "shared":
            return None
        dtype = state_dtype(q)
        window, beyond = self._dense_masks(q, k, call)
        scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2) * call.scaling).masked_fill(~window, float("-inf"))
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weight = torch.sigmoid(self.layer_weights(call).factor.to(dtype))[None, :, None, None]
        query, tokens, _, _ = self._state_inputs(q, k, k, call, None)
        linear = (query @ tokens["k"].transpose(-1, -2)).masked_fill(~beyond, 0.0)
        mass = weight * torch.exp(scores - top) + linear
        return mass / mass.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        window = 4.0 * heads * n * min(n, self.window + self.sinks) * head_dim
        if self.rule.normalized:
            return window + heads * gated_linear_flops(n, head_dim, head_dim + 1, False)
        return window + self.part.flops(n, heads, head_dim, causal)


def _where_entering(tensor: torch.Tensor, enters: torch.Tensor) -> torch.Tensor:
    """``tensor`` (B, H, n, ...) with the tokens that never enter the state (``enters`` (B, n) False) zeroed."""
    mask = enters[:, None, :].reshape(*enters.shape[:1], 1, enters.shape[1], *([1] * (tensor.dim() - 3)))
    return tensor.masked_fill(~mask, 0.0)


def _one_query_softmax_parts(q, keys, values, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, D) of one query per head (B, H, 1, d) over all of ``keys`` (B, Hk, W, d), shifted by the maximum: a
    KV group's query heads as the rows of one product (no repeated keys)."""
    dtype = state_dtype(q)
    batch, heads, _, dim = q.shape
    groups = heads // keys.shape[1]
    grouped = q.reshape(batch, keys.shape[1], groups, dim).to(dtype)
    scores = grouped @ keys.to(dtype).transpose(-1, -2) * scaling  # (B, Hk, G, W)
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    numerator = (weights @ values.to(dtype)).reshape(batch, heads, 1, values.shape[-1])
    return numerator, weights.sum(dim=-1).reshape(batch, heads, 1, 1)


def _masked_softmax_parts(q, k, v, allowed, scaling: float):
    """(N, D) of the softmax over ``allowed`` keys, shifted by the row maximum (the dense form, tests only)."""
    scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    return weights @ v, weights.sum(dim=-1, keepdim=True)
