"""``sdpa``: exact attention through ``torch.nn.functional.scaled_dot_product_attention`` -- the dense
baseline (O(n²) time; on CPU and GPU a flash-style kernel with O(n) memory)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.variant import AttentionCall, Variant


class SDPAAttention(Variant):
    name = "sdpa"
    exact = True
    time_complexity = "O(n²)"
    memory_complexity = "O(n)"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        q_len, kv_len = q.shape[-2], k.shape[-2]
        mask, is_causal = None, call.causal
        if call.padding_mask is not None:
            mask = call.padding_mask[:, None, None, :]  # (B, 1, 1, N): broadcast, never n x n
            if call.causal:
                # SDPA cannot combine is_causal with a mask: this one case builds a (B, 1, Nq, Nk) mask.
                positions = torch.arange(kv_len, device=q.device)
                causal = positions[None, :] <= positions[kv_len - q_len :, None]
                mask = mask & causal
                is_causal = False
        elif call.causal and q_len != kv_len:
            positions = torch.arange(kv_len, device=q.device)
            mask, is_causal = positions[None, :] <= positions[kv_len - q_len :, None], False
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=call.dropout if call.training else 0.0,
            is_causal=is_causal, scale=call.scaling,
        )
