"""``hybrid``: a different variant in each layer -- linear attention in most layers and a short window in one (Based,
Arora et al. 2024), or exact attention every fourth layer and windows elsewhere (the Gemma / ModernBERT local-global
interleave).

``layers`` lists one entry per layer, each a variant name or ``{"variant": name, "params": {...}}``; a model with
more layers than entries cycles through the list (``["longformer", "longformer", "longformer", "sdpa"]`` puts sdpa
in every fourth layer). Every hook of the contract goes to the entry of the layer being run
(``call.layer_idx``, or the ``layer_idx`` argument of :meth:`cache_layer` / :meth:`make_module`): the kernel, the
pattern, the reference, the learned per-layer weights and the decoding cache, so one :class:`zoo.cache.ZooCache`
holds a window layer, a recurrent state and a full key cache side by side, each as its variant would alone.
:meth:`flops` has no layer index: it returns the mean over the entries (the benchmark's per-layer figure).

The model config saves the list (config.json: ``attention_zoo.params.layers``), so a reload rebuilds the same mix.
Causality, bidirectional attention and dropout are checked per layer, with the error the entry's variant would
give. An entry cannot itself be a hybrid.
"""

from __future__ import annotations

from typing import Any

import torch

from zoo.ops import expand_kv
from zoo.pattern import Pattern
from zoo.registry import UnknownVariantError, get_variant_class
from zoo.variant import AttentionCall, Param, Variant, VariantParameterError, reference

EXAMPLE = "[{'variant': 'linear'}, {'variant': 'longformer', 'params': {'window': 64}}]"


class HybridAttention(Variant):
    name = "hybrid"
    exact = False  # refined per instance: exact when every entry is
    supports_causal = True  # checked per layer, against the entry's variant
    supports_bidirectional = True
    supports_dropout = True
    time_complexity = "O(n²) at most: each layer's variant's own"
    memory_complexity = "O(n²) at most: each layer's variant's own"
    error_bound = 0.75  # the loosest built-in's (performer); refined per instance to the entries' largest
    grouped_kv = True  # grouped-query keys reach each layer's variant as that variant takes them
    params = {
        "layers": Param(
            ["sdpa"], list, "one entry per layer (cycled): a variant name or {variant: name, params: {...}}"
        ),
    }
    test_params = {"layers": [{"variant": "longformer", "params": {"window": 16}},
                              {"variant": "linear", "params": {"chunk_size": 16}}]}  # fmt: skip

    def check_config(self) -> None:
        if not self.layers:
            raise VariantParameterError(f"attention-zoo variant 'hybrid': `layers` is empty; give e.g. {EXAMPLE}.")
        entries = [self._entry(item) for item in self.layers]
        self.config.update(layers=entries)  # normalised, as saved in config.json
        self.parts = []
        for index, entry in enumerate(entries):
            try:
                cls = get_variant_class(entry["variant"])
            except UnknownVariantError as exc:
                raise VariantParameterError(f"attention-zoo variant 'hybrid', layer entry {index}: {exc}") from exc
            self.parts.append(cls(**entry["params"]))
        self.exact = all(part.exact for part in self.parts)
        # what every layer supports: zoo.configure refuses a decoder whose layers are not all causal, up front
        self.supports_causal = all(part.supports_causal for part in self.parts)
        self.supports_bidirectional = all(part.supports_bidirectional for part in self.parts)
        self.supports_dropout = all(part.supports_dropout for part in self.parts)
        self.trains_every_parameter = all(part.trains_every_parameter for part in self.parts)  # DDP (zoo.training)
        bounds = [part.error_bound for part in self.parts if not part.exact]
        self.error_bound = max(bounds) if bounds else None

    @staticmethod
    def _entry(item: Any) -> dict:
        if isinstance(item, str):
            item = {"variant": item}
        if not isinstance(item, dict) or not isinstance(item.get("variant"), str) or set(item) - {"variant", "params"}:
            raise VariantParameterError(
                f"attention-zoo variant 'hybrid': layer entry {item!r} must be a variant name or a mapping with "
                f"'variant' and optional 'params', e.g. {EXAMPLE}."
            )
        if item["variant"] == "hybrid":
            raise VariantParameterError("attention-zoo variant 'hybrid': a layer entry cannot itself be 'hybrid'.")
        params = item.get("params") or {}
        if not isinstance(params, dict):
            raise VariantParameterError(f"attention-zoo variant 'hybrid': 'params' of {item!r} must be a mapping.")
        return {"variant": item["variant"], "params": dict(params)}

    def part(self, layer_idx: int) -> Variant:
        """The variant of one layer (the list cycles)."""
        return self.parts[layer_idx % len(self.parts)]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        part = self.part(call.layer_idx)
        part.check_call(call, where=f"in layer {call.layer_idx} of a 'hybrid'")
        if not part.grouped_kv:
            k, v = expand_kv(k, v, q.shape[1])
        return part.attend(q, k, v, call)

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int) -> Pattern | None:
        return self.part(call.layer_idx).pattern(call, q_len, kv_len)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """The layer's variant's reference (:func:`zoo.variant.reference`; tests only, O(n²))."""
        return reference(self.part(call.layer_idx), q, k, v, call)

    def cache_layer(self, layer_idx: int, config: Any):
        return self.part(layer_idx).cache_layer(layer_idx, config)

    def make_module(self, layer_idx: int, config: Any, head_dim: int, num_heads: int) -> torch.nn.Module | None:
        return self.part(layer_idx).make_module(layer_idx, config, head_dim, num_heads)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        return sum(part.flops(n, heads, head_dim, causal) for part in self.parts) / len(self.parts)
