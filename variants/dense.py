"""``dense``: plain softmax attention, materializing the scores. The readable reference every other
variant is tested against. An optional ``pattern`` restricts it (used by tests to build references).
Decoding: transformers' ``DynamicLayer`` (every key), O(n) per token."""

from __future__ import annotations

import torch

from zoo.ops import allowed_mask, softmax_attention
from zoo.variant import AttentionCall, Variant


class DenseAttention(Variant):
    name = "dense"
    exact = True
    supports_cross_attention = True
    time_complexity = "O(n²)"
    memory_complexity = "O(n²)"

    def __init__(self, pattern=None, **params):
        super().__init__(**params)
        self.restrict_to = pattern  # a Variant.pattern-style callable, or None for full attention

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int):
        return self.restrict_to(call, q_len, kv_len) if self.restrict_to is not None else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        batch, heads, q_len, _ = q.shape
        allowed = allowed_mask(call, self.pattern(call, q_len, k.shape[-2]), batch, heads, q_len, k.shape[-2], q.device)
        return softmax_attention(q, k, v, allowed, call.scaling, call.effective_dropout, True)
