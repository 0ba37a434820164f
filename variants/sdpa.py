"""``sdpa``: exact attention through ``torch.nn.functional.scaled_dot_product_attention`` -- the dense
baseline (O(n²) time; on CPU and GPU a flash-style kernel with O(n) memory). A causal padded batch moves every
row's real tokens to the front (:func:`zoo.ops.sdpa_real_tokens_first`) instead of building an n x n mask.
Decoding: transformers' ``DynamicLayer`` (every key), O(n) per token."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.ops import allowed_mask, sdpa_real_tokens_first
from zoo.variant import AttentionCall, Variant


class SDPAAttention(Variant):
    name = "sdpa"
    exact = True
    supports_cross_attention = True
    time_complexity = "O(n²)"
    memory_complexity = "O(n)"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        q_len, kv_len = q.shape[-2], k.shape[-2]
        mask, is_causal = None, call.causal
        if call.causal and q_len != kv_len:  # KV-cache steps: a (B|1, 1, new tokens, N) mask, causality and padding
            mask, is_causal = allowed_mask(call, None, q.shape[0], 1, q_len, kv_len, q.device), False
        elif call.padding_mask is not None:
            if call.causal:
                # SDPA cannot combine is_causal with a mask, and an (n, n) causal mask is quadratic memory.
                return sdpa_real_tokens_first(q, k, v, call.padding_mask, call)
            mask = call.padding_mask[:, None, None, :]  # (B, 1, 1, N): broadcast, never n x n
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=call.effective_dropout,
            is_causal=is_causal, scale=call.scaling,
        )
