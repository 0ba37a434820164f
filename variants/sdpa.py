"""``sdpa``: exact attention through ``torch.nn.functional.scaled_dot_product_attention`` -- the dense
baseline (O(n²) time; on CPU and GPU a flash-style kernel with O(n) memory). A causal padded batch moves every
row's real tokens to the front (:func:`zoo.ops.sdpa_real_tokens_first`) instead of building an n x n mask.
Decoding: transformers' ``DynamicLayer`` (every key), O(n) per token. Grouped-query keys arrive unexpanded
(``grouped_kv``): a decoding step folds each group's query heads into rows against their one key/value head
(:func:`grouped_rows_sdpa`) instead of copying every cached key once per query head, the copy that cost a
GQA model's decode step more than its attention; a prefill expands them (O(n) beside its O(n²))."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.ops import allowed_mask, expand_kv, sdpa_real_tokens_first
from zoo.variant import AttentionCall, Variant


class SDPAAttention(Variant):
    name = "sdpa"
    exact = True
    supports_cross_attention = True
    time_complexity = "O(n²)"
    memory_complexity = "O(n)"
    grouped_kv = True

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        q_len, kv_len = q.shape[-2], k.shape[-2]
        if call.causal and q_len != kv_len:  # KV-cache steps: a (B|1, 1, new tokens, N) mask, causality and padding
            return grouped_rows_sdpa(q, k, v, allowed_mask(call, None, q.shape[0], 1, q_len, kv_len, q.device), call)
        k, v = expand_kv(k, v, q.shape[1])
        mask = None
        if call.padding_mask is not None:
            if call.causal:
                # SDPA cannot combine is_causal with a mask, and an (n, n) causal mask is quadratic memory.
                return sdpa_real_tokens_first(q, k, v, call.padding_mask, call)
            mask = call.padding_mask[:, None, None, :]  # (B, 1, 1, N): broadcast, never n x n
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=call.effective_dropout,
            is_causal=call.causal, scale=call.scaling,
        )

def grouped_rows_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      call: AttentionCall) -> torch.Tensor:
    """SDPA of q (B, H, L, d) against grouped k/v (B, H_kv, N, d): the H / H_kv query heads of a group become rows
    (B, H_kv, G·L, d) against their key/value head; ``mask`` (B|1, 1, L, N) repeats over the group's rows."""
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    if groups * kv_heads != heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly")
    rows = q.reshape(batch, kv_heads, groups * length, dim)
    if mask is not None:
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * length, -1)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, dropout_p=call.effective_dropout,
                                         scale=call.scaling)
    return out.reshape(batch, heads, length, dim)
