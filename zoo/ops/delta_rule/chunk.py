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

W and U (T = (I + ...)⁻¹ diag(β) applied to K and V) come from the explicit inverse of every chunk's system at
once (:func:`unit_lower_inverse`, blocked: log₂ C levels of batched products, no loop over rows); only Δ = U − W S
and the state update run chunk after chunk, inside one autograd Function (:class:`_ChunkLoop`) whose backward is the
adjoint recurrence written out, so autograd records nothing per chunk; the outputs are then two batched products over
all chunks. Time O(n·C·d + n·d²); memory O(n·(C + d)) for the
per-chunk products plus one d_k x d_v state per chunk kept for the backward (nothing of size n x n, nothing is
recomputed). Every exponent is ≤ 0 (b is non-increasing), so nothing overflows.

Accumulation is fp32 (fp64 for fp64 inputs) whatever the input dtype or autocast; the output has ``v``'s dtype.
Tokens with β = 0 and log α = 0 leave the state untouched (how the variants drop padded tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.ops.backends.fla import fla_delta_rule, fla_kernel
from zoo.ops.state import state_dtype

DEFAULT_CHUNK = 64


def _diagonal_blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` x ``size`` blocks on the diagonal of x (R, C, C) as a view (R, C // size, size, size)."""
    rows, full, _ = x.shape
    return x.view(rows, full // size, size, full // size, size).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + L)⁻¹ for the strictly lower part L of each lower (R, C, C) (the rest is never read), by blocked
    inversion from the diagonal out: a block [[A, 0], [L₂₁, B]] inverts to [[A⁻¹, 0], [−B⁻¹ L₂₁ A⁻¹, B⁻¹]], so
    log₂ C levels of two batched products each replace C rows of forward substitution. C is padded to a power of
    two with identity rows."""
    rows, size, _ = lower.shape
    full = 1 << max(0, size - 1).bit_length()
    if full != size:
        lower = F.pad(lower, (0, full - size, 0, full - size))
    inverse = torch.eye(full, dtype=lower.dtype, device=lower.device).expand(rows, full, full).contiguous()
    half = 1
    while half < full:
        blocks, parts = _diagonal_blocks(inverse, 2 * half), _diagonal_blocks(lower, 2 * half)
        first, second = blocks[..., :half, :half], blocks[..., half:, half:]
        blocks[..., half:, :half] = -torch.matmul(torch.matmul(second, parts[..., half:, :half]), first)
        half *= 2
    return inverse[:, :size, :size]


class _UnitLowerSolve(torch.autograd.Function):
    """[W | U] = (I + L)⁻¹ [R_k | R_v] for the strictly lower L of ``lower`` (R, C, C), as two products with the
    explicit inverse (:func:`unit_lower_inverse`, kept for the backward: one C x C matrix per chunk). Backward, with
    X the solution: ∂R = (I + L)⁻ᵀ ∂X, ∂L = −tril(∂R Xᵀ, −1). Replaces ``torch.linalg.solve_triangular``, which on
    CPU solves one matrix at a time (3× slower at C = 64 forward and backward), and returns W and U contiguous."""

    @staticmethod
    def forward(ctx, lower, rhs_keys, rhs_values):
        inverse = unit_lower_inverse(lower)
        w, u = torch.bmm(inverse, rhs_keys), torch.bmm(inverse, rhs_values)
        ctx.save_for_backward(inverse, w, u)
        return w, u

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_w, d_u):
        inverse, w, u = ctx.saved_tensors
        inverse_t = inverse.transpose(-1, -2)
        d_keys = torch.bmm(inverse_t, d_w) if d_w is not None else torch.zeros_like(w)
        d_values = torch.bmm(inverse_t, d_u) if d_u is not None else torch.zeros_like(u)
        d_lower = torch.baddbmm(torch.bmm(d_keys, w.transpose(-1, -2)), d_values, u.transpose(-1, -2))
        return d_lower.neg_().tril_(-1), d_keys, d_values


def unit_lower_solve(lower: torch.Tensor, rhs_keys: torch.Tensor, rhs_values: torch.Tensor):
    """(W, U) = (I + tril(lower, −1))⁻¹ R_k, (I + tril(lower, −1))⁻¹ R_v for batches of C x C systems: what
    ``torch.linalg.solve_triangular(tril(lower, −1), cat([R_k, R_v], −1), upper=False, unitriangular=True)`` gives,
    split."""
    return _UnitLowerSolve.apply(lower, rhs_keys, rhs_values)


class _ChunkLoop(torch.autograd.Function):
    """The only sequential part of the chunkwise form, chunk after chunk from the state S entering it:

        Δ = U − W S,    S ← e^{b_C} S + K̃ᵀ Δ

    with a hand-written backward (the adjoint recurrence, G the gradient of the state leaving a chunk:
    ∂Δ += K̃ G, ∂S = e^{b_C} G + ∂S_entering − Wᵀ ∂Δ; then ∂U = ∂Δ, ∂W = −∂Δ Sᵀ, ∂K̃ = Δ Gᵀ and ∂e^{b_C} = ⟨G, S⟩
    for all chunks at once), so autograd records nothing per chunk. u (N, c, C, d_v), w and keys (N, c, C, d_k),
    decay (N, c) or None (no decay), s0 (N, d_k, d_v) -> (the state entering each chunk (N, c, d_k, d_v), Δ
    (N, c, C, d_v), the final state (N, d_k, d_v))."""

    @staticmethod
    def forward(ctx, u, w, keys, decay, s0):
        states, deltas = [], []
        state = s0
        for i in range(u.shape[1]):
            states.append(state)
            delta = torch.baddbmm(u[:, i], w[:, i], state, alpha=-1)
            deltas.append(delta)
            carried = state if decay is None else state * decay[:, i, None, None]
            state = torch.baddbmm(carried, keys[:, i].transpose(-1, -2), delta)
        entering, delta = torch.stack(states, dim=1), torch.stack(deltas, dim=1)
        ctx.save_for_backward(w, keys, decay, entering, delta)
        return entering, delta, state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_entering, d_delta, d_final):
        w, keys, decay, entering, delta = ctx.saved_tensors
        chunks = w.shape[1]
        grad = d_final if d_final is not None else entering.new_zeros(entering[:, 0].shape)
        leaving, d_deltas = [], []  # last chunk first
        for i in range(chunks - 1, -1, -1):
            leaving.append(grad)
            dd = torch.matmul(keys[:, i], grad) if d_delta is None else torch.baddbmm(d_delta[:, i], keys[:, i], grad)
            d_deltas.append(dd)
            back = grad if decay is None else grad * decay[:, i, None, None]
            if d_entering is not None:
                back = back + d_entering[:, i]
            grad = torch.baddbmm(back, w[:, i].transpose(-1, -2), dd, alpha=-1)
        leaving, dd = torch.stack(leaving[::-1], dim=1), torch.stack(d_deltas[::-1], dim=1)
        d_w = -torch.matmul(dd, entering.transpose(-1, -2))
        d_keys = torch.matmul(delta, leaving.transpose(-1, -2))
        d_decay = (leaving * entering).sum((-1, -2)) if decay is not None else None
        return dd, d_w, d_keys, d_decay, grad


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
    installed (:mod:`zoo.ops.backends.fla`; the same recurrence, an fp32 final state)."""
    if (kernel := fla_kernel("delta_rule" if log_decay is None else "gated_delta_rule", q, k, v)) is not None:
        return fla_delta_rule(kernel, q, k, v, beta, log_decay, scale, initial_state)
    if k.shape[2] == 1:  # a decoding step: the recurrence's one step, without a chunk's solve and loop
        return _one_token(q, k, v, beta, log_decay, scale, initial_state)
    dtype, out_dtype = state_dtype(v), v.dtype
    with torch.autocast(device_type=v.device.type, enabled=False):
        q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
        batch, heads, n, d_k = k.shape
        d_v = v.shape[-1]
        chunk = max(1, min(chunk_size, n))
        pad = (-n) % chunk
        if pad:  # padded tokens: β = 0, log α = 0, so they change nothing
            q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
            beta = F.pad(beta, (0, pad))
        chunks = (n + pad) // chunk
        rows = batch * heads * chunks  # every chunk of every head: one batch of C x d matrices
        qc, kc, vc = (x.reshape(rows, chunk, x.shape[-1]) for x in (q, k, v))
        betac = beta.reshape(rows, chunk, 1)
        keys_t = kc.transpose(-1, -2)
        beta_keys = kc * betac
        if log_decay is not None:
            g = log_decay.to(dtype)
            if pad:
                g = F.pad(g, (0, pad))
            b = g.reshape(rows, chunk).cumsum(-1)
            causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
            gamma = (b[:, :, None] - b[:, None, :]).masked_fill(~causal, float("-inf")).exp()
            lower = torch.bmm(beta_keys, keys_t) * gamma  # only its strictly lower part is read
            scores = torch.bmm(qc, keys_t) * gamma  # Γ is 0 above the diagonal
            grow = b.exp()[..., None]  # e^{b_t}: the decay from the chunk start to token t
            rhs_keys, queries = beta_keys * grow, qc * grow
            state_keys = kc * (b[:, -1:] - b).exp()[..., None]  # e^{b_C − b_t}: from token t to the chunk end
            carry = b[:, -1].exp()  # e^{b_C}
        else:
            lower = torch.bmm(beta_keys, keys_t)  # diag(β) K Kᵀ: its strictly lower part (the diagonal is unit)
            scores = torch.bmm(qc, keys_t).tril()
            rhs_keys, queries, state_keys, carry = beta_keys, qc, kc, None
        w, u = unit_lower_solve(lower, rhs_keys, vc * betac)
        state = (initial_state.to(dtype).reshape(batch * heads, d_k, d_v) if initial_state is not None
                 else v.new_zeros(batch * heads, d_k, d_v))
        per_head = (batch * heads, chunks, chunk)
        entering, delta, state = _ChunkLoop.apply(
            u.reshape(*per_head, d_v), w.reshape(*per_head, d_k), state_keys.view(*per_head, d_k),
            None if carry is None else carry.view(batch * heads, chunks), state,
        )
        entering, delta = entering.view(rows, d_k, d_v), delta.view(rows, chunk, d_v)
        out = torch.baddbmm(torch.bmm(scores, delta), queries, entering, beta=scale, alpha=scale)
        out = out.view(batch, heads, chunks * chunk, d_v)[:, :, :n]
    return out.to(out_dtype), state.view(batch, heads, d_k, d_v)


def _one_token(q, k, v, beta, log_decay, scale: float, initial_state) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`delta_rule` of one token (n = 1) in four products: S ← α S, S ← S + β k (v − Sᵀk)ᵀ, o = scale · Sᵀq."""
    dtype, out_dtype = state_dtype(v), v.dtype
    with torch.autocast(device_type=v.device.type, enabled=False):
        q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
        batch, heads, _, d_k = k.shape
        state = (initial_state.to(dtype) if initial_state is not None
                 else v.new_zeros(batch, heads, d_k, v.shape[-1]))
        if log_decay is not None:
            state = state * log_decay.to(dtype).exp()[..., None]  # (B, H, 1, 1): α per head
        error = v - k @ state  # (B, H, 1, d_v)
        state = state + k.transpose(-1, -2) @ (beta[..., None] * error)
        return (scale * (q @ state)).to(out_dtype), state


def delta_rule_flops(n: int, d_k: int, d_v: int, chunk_size: int = DEFAULT_CHUNK) -> float:
    """Forward FLOPs of :func:`delta_rule` for one head: chunk products (Q Kᵀ, K Kᵀ, the solve, scores · Δ) and the
    state products (W S, Q S, Kᵀ Δ)."""
    c = min(chunk_size, n)
    chunk_part = 2.0 * n * c * (2 * d_k + (d_k + d_v) + d_v)  # QKᵀ, KKᵀ, the triangular solve, scores · Δ
    state_part = 2.0 * n * d_k * d_v * 3  # W S, Q S, Kᵀ Δ
    return chunk_part + state_part
