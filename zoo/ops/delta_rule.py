"""The (gated) delta rule: a recurrent state S (d_k x d_v per head) written by error correction,

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,    o_t = scale · S_tᵀ q_t

(DeltaNet: α = 1, Schlag et al. 2021; Gated DeltaNet: α_t ∈ (0, 1], Yang et al. 2025). Plain tensors in, plain
tensors out: the variants (``deltanet``, ``gated_deltanet``) build q, k, β and log α.

:func:`delta_rule` is the chunkwise-parallel form (Yang et al. 2024, "Parallelizing Linear Transformers with the
Delta Rule over Sequence Length"), written here from the algebra. Inside a chunk of C tokens that starts from
state S, with b_t = Σ_{s ≤ t} log α_s the decay accumulated since the chunk started and Γ_ts = exp(b_t − b_s)
(s ≤ t; all ones without gating), the corrections δ_t = β_t (v_t − (α_t S_{t−1})ᵀ k_t) solve one unit lower
triangular system (the UT transform):

    (I + tril(diag(β) (K Kᵀ ⊙ Γ), −1)) [W | U] = diag(β) [diag(e^b) K | V],    Δ = U − W S
    O = scale · (diag(e^b) Q S + (Q Kᵀ ⊙ Γ ⊙ causal) Δ),    S ← e^{b_C} S + (diag(e^{b_C − b}) K)ᵀ Δ

W and U (T = (I + ...)⁻¹ diag(β) applied to K and V) come from one ``torch.linalg.solve_triangular`` over every
chunk at once; only the state update runs chunk after chunk. Time O(n·C·d + n·d²); memory O(n·(C + d)) for the
per-chunk products plus one d_k x d_v state per chunk kept for the backward (autograd through the chunked form:
nothing of size n x n, nothing is recomputed). Every exponent is ≤ 0 (b is non-increasing), so nothing overflows.

Accumulation is fp32 (fp64 for fp64 inputs) whatever the input dtype or autocast; the output has ``v``'s dtype.
Tokens with β = 0 and log α = 0 leave the state untouched (how the variants drop padded tokens).
"""

from __future__ import annotations

import torch

from zoo.ops.fla_backend import fla_delta_rule, fla_kernel

DEFAULT_CHUNK = 64


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs, else fp32: the dtype states are accumulated in."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def carried(kernel, state: dict | None, key: str, *args, **kwargs) -> torch.Tensor:
    """``kernel(*args, initial_state=state[key])``'s output, ``state[key]`` replaced by its final state; without a
    ``state`` (a recurrent cache's dict) it starts from zeros and keeps nothing."""
    out, final = kernel(*args, initial_state=None if state is None else state.get(key), **kwargs)
    if state is not None:
        state[key] = final
    return out


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    scale: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise (gated) delta rule. q, k (B, H, n, d_k); v (B, H, n, d_v); beta (B, H, n); log_decay (B, H, n)
    (log α ≤ 0) or None; ``initial_state`` (B, H, d_k, d_v) or None (zeros). Returns (out (B, H, n, d_v) in v's
    dtype, final state (B, H, d_k, d_v) in the compute dtype). bf16/fp16 CUDA calls run on fla's kernels when it is
    installed (:mod:`zoo.ops.fla_backend`; the same recurrence, an fp32 final state)."""
    if (kernel := fla_kernel("delta_rule" if log_decay is None else "gated_delta_rule", q, k, v)) is not None:
        return fla_delta_rule(kernel, q, k, v, beta, log_decay, scale, initial_state)
    dtype, out_dtype = compute_dtype(v), v.dtype
    with torch.autocast(device_type=v.device.type, enabled=False):
        q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
        batch, heads, n, d_k = k.shape
        d_v = v.shape[-1]
        chunk = max(1, min(chunk_size, n))
        pad = (-n) % chunk
        if pad:  # padded tokens: β = 0, log α = 0, so they change nothing
            q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
            beta = torch.nn.functional.pad(beta, (0, pad))
        chunks = (n + pad) // chunk
        qc, kc, vc = (x.reshape(batch, heads, chunks, chunk, x.shape[-1]) for x in (q, k, v))
        betac = beta.reshape(batch, heads, chunks, chunk, 1)
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
        scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # (B, H, c, C, C)
        keys = torch.matmul(kc, kc.transpose(-1, -2))
        if log_decay is not None:
            g = log_decay.to(dtype)
            if pad:
                g = torch.nn.functional.pad(g, (0, pad))
            b = g.reshape(batch, heads, chunks, chunk).cumsum(-1)
            gamma = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf")).exp()
            scores, keys = scores * gamma, keys * gamma
            grow = b.exp()[..., None]  # e^{b_t}: the decay from the chunk start to token t
            to_end = (b[..., -1:] - b).exp()[..., None]  # e^{b_C − b_t}: from token t to the chunk end
            decayed_keys, queries, state_keys = kc * grow, qc * grow * scale, kc * to_end
            chunk_decay = b[..., -1].exp()  # (B, H, c)
        else:
            decayed_keys, queries, state_keys, chunk_decay = kc, qc * scale, kc, None
        lower = (keys * betac).tril(-1)  # diag(β) (K Kᵀ ⊙ Γ), strictly lower; the solver takes the unit diagonal
        rhs = torch.cat([decayed_keys, vc], dim=-1) * betac
        solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
        w, u = solved.split([d_k, d_v], dim=-1)
        scores = scores.masked_fill(~causal, 0.0)
        state = (initial_state.to(dtype) if initial_state is not None
                 else v.new_zeros(batch, heads, d_k, d_v))
        # unbind once: indexing chunk c of a whole-sequence tensor would give each chunk a whole-sequence gradient
        per_chunk = zip(*(x.unbind(2) for x in (u, w, queries, scores, state_keys)), strict=True)
        decays = chunk_decay.unbind(2) if chunk_decay is not None else [None] * chunks
        outs = []
        for (u_c, w_c, q_c, scores_c, keys_c), decay in zip(per_chunk, decays, strict=True):
            delta = u_c - torch.matmul(w_c, state)
            outs.append(torch.matmul(q_c, state) + torch.matmul(scores_c, delta))
            carried = state if decay is None else state * decay[..., None, None]
            state = carried + torch.matmul(keys_c.transpose(-1, -2), delta)
        out = torch.stack(outs, dim=2).reshape(batch, heads, chunks * chunk, d_v)[:, :, :n]
    return out.to(out_dtype), state


def delta_rule_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, one token at a time (the variants' ``reference`` and the tests): same arguments and results
    as :func:`delta_rule`. O(n·d_k·d_v) time, but a Python loop over tokens."""
    dtype, out_dtype = compute_dtype(v), v.dtype
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


def delta_rule_flops(n: int, d_k: int, d_v: int, chunk_size: int = DEFAULT_CHUNK) -> float:
    """Forward FLOPs of :func:`delta_rule` for one head: chunk products (Q Kᵀ, K Kᵀ, the solve, scores · Δ) and the
    state products (W S, Q S, Kᵀ Δ)."""
    c = min(chunk_size, n)
    chunk_part = 2.0 * n * c * (2 * d_k + (d_k + d_v) + d_v)  # QKᵀ, KKᵀ, the triangular solve, scores · Δ
    state_part = 2.0 * n * d_k * d_v * 3  # W S, Q S, Kᵀ Δ
    return chunk_part + state_part
