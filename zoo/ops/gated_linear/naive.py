"""The gated linear recurrence token by token: the readable definition the chunkwise kernel
(:func:`zoo.ops.gated_linear.gated_linear_attention`) is tested against and the ``gla`` variant's ``reference``.

    S_t = Diag(α_t) S_{t−1} + k_t v_tᵀ,    o_t = scale · S_tᵀ q_t
"""

from __future__ import annotations

import torch

from zoo.ops.state import state_dtype


def gated_linear_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, token by token: same arguments and results as
    :func:`zoo.ops.gated_linear.gated_linear_attention`."""
    dtype, out_dtype = state_dtype(v), v.dtype
    with torch.autocast(device_type=v.device.type, enabled=False):
        q, k, v, g = (x.to(dtype) for x in (q, k, v, log_decay))
        batch, heads, n, d_k = k.shape
        state = initial_state.to(dtype) if initial_state is not None else v.new_zeros(batch, heads, d_k, v.shape[-1])
        outs = []
        for t in range(n):
            alpha = g[:, :, t].exp()
            alpha = alpha[..., :, None] if g.dim() == 4 else alpha[..., None, None]
            state = alpha * state + k[:, :, t, :, None] * v[:, :, t, None, :]
            outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
        out = torch.stack(outs, dim=2) if outs else v.new_zeros(batch, heads, 0, v.shape[-1])
    return out.to(out_dtype), state
