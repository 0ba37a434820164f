"""``chunked_exact``: exact softmax attention computed one query chunk at a time.

Memory O(n · chunk_size) instead of O(n²); time O(n²). A complete third-party variant in one file.
"""

import torch

from zoo import AttentionCall, Param, Variant
from zoo.ops import softmax_attention


class ChunkedExactAttention(Variant):
    name = "chunked_exact"
    exact = True
    time_complexity = "O(n²)"
    memory_complexity = "O(n·c)"
    params = {"chunk_size": Param(256, int, "queries per chunk", min=1)}
    test_params = {"chunk_size": 32}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        q_len, kv_len = q.shape[-2], k.shape[-2]
        key_positions = torch.arange(kv_len, device=q.device)
        key_ok = call.padding_mask[:, None, None, :] if call.padding_mask is not None else None
        chunks = []
        for start in range(0, q_len, self.chunk_size):
            stop = min(start + self.chunk_size, q_len)
            allowed = key_ok
            if call.causal:
                query_positions = torch.arange(start, stop, device=q.device) + (kv_len - q_len)
                causal = key_positions[None, :] <= query_positions[:, None]
                allowed = causal if allowed is None else allowed & causal
            chunks.append(
                softmax_attention(q[..., start:stop, :], k, v, allowed, call.scaling, call.dropout, call.training)
            )
        return torch.cat(chunks, dim=-2)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        return 4.0 * n * n * heads * head_dim
