"""The (gated) delta rule one token at a time: the readable definition the chunkwise kernel
(:func:`zoo.ops.delta_rule.delta_rule`) is tested against and the variants' ``reference``.

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,    o_t = scale · S_tᵀ q_t
"""

from __future__ import annotations

import torch

from zoo.ops.state import state_dtype


def delta_rule_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, one token at a time: same arguments and results as :func:`zoo.ops.delta_rule.delta_rule`.
    O(n·d_k·d_v) time, but a Python loop over tokens."""
    dtype, out_dtype = state_dtype(v), v.dtype
    with torch.autocast(device_type=v.device.type, enabled=False):
        q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
        batch, heads, n, d_k = k.shape
        state = (initial_state.to(dtype) if initial_state is not None
                 else v.new_zeros(batch, heads, d_k, v.shape[-1]))
        outs = []
        for t in range(n):
            if log_decay is not None:
                state = state * log_decay[:, :, t, None, None].to(dtype).exp()
            k_t = k[:, :, t]
            error = v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, state)  # v_t − Sᵀ k_t
            state = state + beta[:, :, t, None, None] * k_t[..., :, None] * error[..., None, :]
            outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
        out = torch.stack(outs, dim=2) if outs else v.new_zeros(batch, heads, 0, v.shape[-1])
    return out.to(out_dtype), state
