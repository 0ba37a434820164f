"""``duo``: a head-level layout (DuoAttention, Xiao et al. 2024): in each layer the KV heads listed in ``full_heads``
(with their query heads) attend to every earlier key through the ``inner`` exact variant; every other KV head is a
streaming head that sees the first ``sinks`` real tokens of its row and the last ``recent`` tokens
(:mod:`zoo.ops.streaming`), in the prefill and in decoding alike, as DuoAttention deploys it.

``full_heads``: one list of KV head indices per layer, or a single list for every layer; ``[]`` makes a layer all
streaming. The layout is saved in config.json (``attention_zoo.params.full_heads``) and restored by
``from_pretrained``. Choosing the heads (DuoAttention's trained gates or a training-free score):
``recipes/duo.py``.

Kernel: one call of ``inner`` over the full heads and one streaming call over the others (queries in blocks; never an
n x n tensor), their outputs put back in head order. Decoding: :class:`zoo.cache.HeadSplitLayer` keeps every key of
the full heads only, so the cache holds ``full/kv_heads`` of the full cache plus ``(sinks + recent)`` keys per
streaming head, counted by ``zoo.cache_nbytes``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from zoo.variants.sdpa import grouped_rows_sdpa

from zoo.cache import BudgetedLayer, HeadSplitLayer
from zoo.ops import allowed_mask, expand_kv, softmax_attention
from zoo.ops.streaming import gather_sinks, sink_positions, streaming_attention
from zoo.registry import get_variant_class
from zoo.variant import AttentionCall, Param, Variant, VariantParameterError

EXAMPLE = "full_heads=[[0], [1, 2], []] (layer 0 keeps KV head 0 full, layer 1 heads 1 and 2, layer 2 none)"


class DuoAttention(Variant):
    name = "duo"
    exact = True  # softmax restricted to its per-head pattern
    supports_bidirectional = False  # streaming heads see the past only
    supports_dropout = False
    grouped_kv = True
    time_complexity = "O(n²) on the full heads, O(n·(sinks + recent)) on the others"
    memory_complexity = "O(n) keys for the full heads, O(sinks + recent) for the others"
    params = {
        "full_heads": Param([[]], list, "KV head indices kept full: one list per layer, or one list for all"),
        "sinks": Param(64, int, "first real tokens of each row every streaming head keeps (DuoAttention deploys 64)",
                       min=0),
        "recent": Param(256, int, "latest tokens (the query's own included) every streaming head keeps", min=1),
        "inner": Param("sdpa", str, "the exact full-attention variant of the full heads"),
        "full_budget": Param(None, dict, "decoding only: a budget on the full heads' cache, {'budget': share of the "
                             "prompt kept, or 'tokens': count, and the budget's 'policy', 'sinks', 'recent', 'slack'}",
                             optional=True),
    }
    test_params = {"full_heads": [[0]], "sinks": 2, "recent": 8}

    def check_config(self) -> None:
        layers = self.full_heads
        if not layers or not all(isinstance(heads, list) for heads in layers):
            raise VariantParameterError(f"attention-zoo variant 'duo': parameter 'full_heads' = {layers!r} must be "
                                        f"a list of lists of KV head indices, e.g. {EXAMPLE}.")
        for index, heads in enumerate(layers):
            if any(not isinstance(head, int) or isinstance(head, bool) or head < 0 for head in heads) or (
                    len(set(heads)) != len(heads)):
                raise VariantParameterError(
                    f"attention-zoo variant 'duo': full_heads[{index}] = {heads!r} must list distinct KV head "
                    f"indices >= 0, e.g. {EXAMPLE}.")
        self.config.update(full_heads=[sorted(heads) for heads in layers])
        inner = get_variant_class(self.inner)()
        if not inner.exact or inner.pattern(AttentionCall(causal=True, scaling=1.0), 1, 1) is not None:
            raise VariantParameterError(f"attention-zoo variant 'duo': parameter 'inner' = {self.inner!r} is not an "
                                        "exact full-attention variant; use 'sdpa' or 'dense'.")
        self.inner_variant = inner
        self.budget_variant = self._budget_variant()

    def _budget_variant(self) -> Variant | None:
        """The ``budget`` variant that runs the full heads over a budgeted cache (None without ``full_budget``)."""
        spec = self.full_budget
        if spec is None:
            return None
        unknown = set(spec) - {"budget", "tokens", "policy", "sinks", "recent", "slack"}
        share = spec.get("budget")
        if unknown or (share is None) == (spec.get("tokens") is None) or (
                share is not None and not 0 < share <= 1):
            raise VariantParameterError(
                f"attention-zoo variant 'duo': parameter 'full_budget' = {spec!r} must give either 'budget' (the "
                "share of the prompt the full heads keep, in (0, 1]) or 'tokens', plus optional 'policy', 'sinks', "
                "'recent', 'slack'; e.g. {'budget': 0.25, 'policy': 'snapkv'}.")
        options = {key: spec[key] for key in ("policy", "sinks", "recent", "slack") if key in spec}
        try:
            return get_variant_class("budget")(inner=self.inner, tokens=spec.get("tokens") or 10**9, **options)
        except VariantParameterError as exc:
            raise VariantParameterError(f"attention-zoo variant 'duo': parameter 'full_budget': {exc}") from exc

    def _budgeted_layer(self, max_positions: int | None):
        """``prompt length -> BudgetedLayer`` for the full heads: keeps ``budget`` of the prompt (at least the sinks
        and the recent keys) or ``tokens``."""
        budget = self.budget_variant

        def build(prompt: int) -> BudgetedLayer:
            share = self.full_budget.get("budget")
            floor = budget.sinks + budget.recent
            tokens = max(floor, math.ceil(share * prompt)) if share is not None else budget.tokens
            return budget.layer_of(tokens, max_positions)

        return build

    def heads_of(self, layer_idx: int, kv_heads: int | None = None) -> list[int]:
        """The KV heads layer ``layer_idx`` keeps full (checked against ``kv_heads`` when given)."""
        layers = self.full_heads
        if len(layers) != 1 and layer_idx >= len(layers):
            raise VariantParameterError(
                f"attention-zoo variant 'duo': full_heads has {len(layers)} lists but the model has a layer "
                f"{layer_idx}; give one list per layer (or a single list for all), e.g. {EXAMPLE}.")
        heads = layers[0] if len(layers) == 1 else layers[layer_idx]
        if kv_heads is not None and heads and heads[-1] >= kv_heads:
            raise VariantParameterError(
                f"attention-zoo variant 'duo': full_heads for layer {layer_idx} = {heads} names KV head "
                f"{heads[-1]}, but the model has {kv_heads} key/value heads (indices 0..{kv_heads - 1}). Name KV "
                "heads, not query heads: a KV head keeps its whole query group.")
        return heads

    def check_model(self, config: Any) -> None:
        """Refuse a layout that does not fit the model, before any work."""
        layers = getattr(config, "num_hidden_layers", None)
        if layers is not None and len(self.full_heads) not in (1, layers):
            raise VariantParameterError(
                f"attention-zoo variant 'duo': full_heads has {len(self.full_heads)} lists for a model of {layers} "
                f"layers; give one list per layer (or a single list for all), e.g. {EXAMPLE}.")
        kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
        for layer_idx in range(len(self.full_heads)):
            self.heads_of(layer_idx, kv_heads)
        positions = getattr(config, "max_position_embeddings", None)
        if positions is not None and self.sinks + self.recent > positions:
            raise VariantParameterError(
                f"attention-zoo variant 'duo': sinks + recent = {self.sinks + self.recent} exceeds the model's "
                f"max_position_embeddings={positions}; lower 'recent' (a streaming head would see everything).")

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> None:
        if layer_idx == 0:
            self.check_model(config)
        return None

    def cache_layer(self, layer_idx: int, config: Any) -> HeadSplitLayer:
        kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
        positions = getattr(config, "max_position_embeddings", None)
        budgeted = self._budgeted_layer(positions) if self.budget_variant is not None else None
        return HeadSplitLayer(self.heads_of(layer_idx, kv_heads), self.sinks, self.recent, max_positions=positions,
                              full_budget=budgeted)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Softmax restricted to the layout, per query head (O(n²), tests only): a full head sees every key; a
        streaming head its row's first ``sinks`` real tokens and the last ``recent``; causality and padding on top."""
        kv_heads = k.shape[1]
        group = q.shape[1] // kv_heads
        full = torch.zeros(q.shape[1], dtype=torch.bool, device=q.device)
        full[_query_heads(self.heads_of(call.layer_idx, kv_heads), group, q.device)] = True
        allowed = allowed_mask(call, None, q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], q.device)
        key_pos = call.positions.to(q.device) if call.positions is not None else torch.arange(k.shape[-2],
                                                                                             device=q.device)
        query_pos = key_pos[-q.shape[-2]:]
        start = call.row_start.to(q.device) if call.row_start is not None else torch.zeros(q.shape[0], dtype=torch.long,
                                                                                           device=q.device)
        window = key_pos[None, :] > query_pos[:, None] - self.recent  # (Q, K)
        sink = key_pos[None, None, :] < start[:, None, None] + self.sinks  # (B, 1, K)
        pattern = full[None, :, None, None] | (window[None, None] | sink[:, None])
        pattern = pattern if allowed is None else pattern & allowed
        expanded_k, expanded_v = expand_kv(k, v, q.shape[1])
        return softmax_attention(q, expanded_k, expanded_v, pattern, call.scaling)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        layer = call.cache if isinstance(call.cache, HeadSplitLayer) else None
        kv_heads = k.shape[1]
        full = self.heads_of(call.layer_idx, kv_heads)
        group = q.shape[1] // kv_heads
        streaming = [head for head in range(kv_heads) if head not in full]
        outs, order = [], []
        if full:
            queries = _query_heads(full, group, q.device)
            if layer is not None:
                keys, values = layer.full.keys, layer.full.values
            else:
                index = torch.tensor(full, dtype=torch.long, device=q.device)
                keys, values = k.index_select(1, index), v.index_select(1, index)
            if layer is not None and isinstance(layer.full, BudgetedLayer):  # its keys, then its eviction
                out = self.budget_variant.attend(q.index_select(1, queries), keys, values,
                                                 dataclasses.replace(call, cache=layer.full))
            else:
                out = self.inner_variant.attend(q.index_select(1, queries), keys, values, call)
            outs.append(out)
            order.append(queries)
        if streaming:
            queries = _query_heads(streaming, group, q.device)
            outs.append(self._streaming(q.index_select(1, queries), k, v, streaming, layer, call))
            order.append(queries)
        if len(outs) == 1:
            return outs[0]
        inverse = torch.argsort(torch.cat(order))
        return torch.cat(outs, dim=1).index_select(1, inverse)

    def _streaming(self, q, k, v, streaming: list[int], layer: HeadSplitLayer | None, call: AttentionCall):
        """The streaming heads' attention over the layer's sinks and window, or over k/v (no cache)."""
        real = call.padding_mask
        if layer is not None and q.shape[-2] == 1 and layer.fast(real):  # every held key, no mask
            return grouped_rows_sdpa(q, layer.stream_keys, layer.stream_values, None, call)
        if layer is not None:
            keys, values = layer.window_run()
            end = layer.seen
            sink_keys, sink_values, sink_pos = layer.sinks_for_call()
        else:
            index = torch.tensor(streaming, dtype=torch.long, device=q.device)
            keys, values, end = k.index_select(1, index), v.index_select(1, index), k.shape[-2]
            positions = sink_positions(call.row_start, q.shape[0], self.sinks, q.device)
            sink_keys, sink_values, found = gather_sinks(keys, values, positions, 0)
            sink_pos = torch.where(found, positions, torch.full_like(positions, -1))
        if real is not None:
            real = real[:, -keys.shape[-2]:]
        return streaming_attention(q, keys, values, sink_keys, sink_values, sink_pos, self.recent, call.scaling,
                                   end, real)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        """The model's share is unknown here: the figure of a layer with every head streaming."""
        keys = min(n, self.sinks + self.recent)
        return 4.0 * heads * n * keys * head_dim


def _query_heads(kv_heads: list[int], group: int, device: torch.device) -> torch.Tensor:
    """The query heads of ``kv_heads`` (each KV head's ``group`` query heads, in order)."""
    heads = torch.tensor(kv_heads, dtype=torch.long, device=device)
    return (heads[:, None] * group + torch.arange(group, device=device)).flatten()

