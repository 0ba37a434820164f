"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2, 2025): a lightning indexer picks each query's ``top_k`` keys and the
attention reads only those.

Indexer: ``I(t, s) = Σ_j w_tj · ReLU(q^I_tj · k^I_s)`` over a few small heads j (queries ``index_q`` (B, Q, h, d_I),
weights ``index_w`` (B, Q, h), one key ``index_k`` (B, n, d_I) per token). The keys eligible for query t are the real
keys at positions ≤ t; the ``top_k`` highest scores win and ties go to the later (nearer) key, the same in the kernel,
the dense reference and decoding. Scores are computed chunk by chunk of queries (O(n²·h·d_I) time, (chunk, n) at a
time, never n x n) without gradient: the selection is a hard choice, shared by every attention head of the query.

Attention over the selection (:func:`token_attention`): on CUDA with triton installed, the zoo's Triton kernels read
each query's selected rows of k and v in tiles, in place, forward and backward (:mod:`zoo.ops.backends.triton_dsa`).
Otherwise each chunk of queries gathers its keys and values for every
head with one ``index_select`` each (rows of the (B·H·n, D) views) and runs the flash kernel, one tiny problem per
(query, head); the backward gathers again (recompute) and ``index_add_``s the key and value gradients. O(n·k·d) time,
O(n·k) memory for the selection (shared by the heads) plus one chunk of gathered keys. The cost is the gather's memory
traffic (H·D values of k and of v per selected key and query), not its arithmetic.

Training the indexer (:func:`zoo.ops.dsa.indexer.indexer_kl`): KL(p_t ‖ softmax_s I(t, s)) over each query's
selected keys, p_t the main attention's probabilities summed over heads and L1-normalised (a detached target), as the
paper's sparse stage; the kernel computes p_t from the keys it has just read (``with_target``: the CPU kernel and the
Triton kernels), so the loss reads no attention key again; the KL itself (its gradients to the indexer's projections)
stays in torch, over the indexer's own d_I-channel keys.
"""

from __future__ import annotations

import torch

from zoo.call import AttentionCall
from zoo.ops import limits
from zoo.ops.backends.triton_dsa import triton_kernel
from zoo.ops.choose import select_by_query_chunks, top_positions
from zoo.ops.dropout import Dropout, attention_backward, attention_forward
from zoo.ops.flash import additive_mask, flash_available
from zoo.ops.gathered import device_chunks, key_rows, recomputed


def indexer_scores(index_q: torch.Tensor, index_w: torch.Tensor, index_k: torch.Tensor) -> torch.Tensor:
    """(B, Q, n) fp32: Σ_j w_tj · ReLU(q^I_tj · k^I_s); queries (B, Q, h, d_I), weights (B, Q, h), keys (B, n, d_I)."""
    batch, count, heads, _ = index_q.shape
    logits = torch.matmul(index_q.float().flatten(1, 2), index_k.float().transpose(-1, -2)).relu_()  # (B, Q·h, n)
    return torch.matmul(index_w.float().unsqueeze(-2), logits.view(batch, count, heads, -1)).squeeze(-2)


def top_tokens(scores: torch.Tensor, eligible: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` eligible keys of the highest score, ties to the later key (DSA's choice):
    :func:`zoo.ops.choose.top_positions` with ``ties_to_later=True``."""
    return top_positions(scores, eligible, top_k, ties_to_later=True)


def select_tokens(index_q: torch.Tensor, index_w: torch.Tensor, index_k: torch.Tensor, query_positions: torch.Tensor,
                  key_real: torch.Tensor | None, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's ``top_k`` keys, chunk by chunk of queries, without gradient: (index, chosen), each (B, Q, k').

    ``query_positions`` (Q,) ascending: positions of the queries among the n keys (keys after a query are not
    eligible, so a chunk scores only the keys up to its last query); ``key_real`` (B|1, n) bool or None."""
    batch, count, heads, _ = index_q.shape
    n = index_k.shape[-2]
    key_positions = torch.arange(n, device=index_q.device)
    width = min(top_k, n)

    def select(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        seen = max(int(query_positions[rows.stop - 1]) + 1, width)  # keys any query of the chunk may read
        scores = indexer_scores(index_q[:, rows], index_w[:, rows], index_k[:, :seen])
        eligible = (key_positions[:seen] <= query_positions[rows, None])[None]
        if key_real is not None:
            eligible = eligible & key_real[:, None, :seen]
        index, chosen = top_tokens(scores, eligible.expand_as(scores), top_k)
        return index.masked_fill_(~chosen, n - 1), chosen

    return select_by_query_chunks(select, count, batch * heads * n, 1)


def token_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, chosen: torch.Tensor,
                    call: AttentionCall, with_target: bool = False):
    """(B, H, Q, Dv): each query over its selected keys (index/chosen (B, Q, k'), shared by the heads; k/v may hold
    fewer heads only on the Triton path). CUDA with triton: the zoo's Triton kernels, reading the selected rows in
    place (:mod:`zoo.ops.backends.triton_dsa`); CPU: chunked flash with a recomputing backward; elsewhere chunks of
    queries (:func:`zoo.ops.gathered.device_chunks`), each one gather and one SDPA call, recomputed in the backward.
    ``with_target``: also returns the indexer's KL target (B, Q, k') (:func:`zoo.ops.dsa.indexer.indexer_kl`) from
    the keys just read (Triton, CPU), None elsewhere."""
    if (kernel := triton_kernel(q, k, v, call)) is not None:
        out, target = kernel(q, k, v, index, chosen, call.scaling, with_target)
        return (out, target) if with_target else out
    if flash_available(q):
        out, target = _TokenGathered.apply(q, k, v, index, chosen, call.scaling, Dropout.of(call), with_target)
        return (out, target) if with_target else out
    batch, heads, count, dim = q.shape
    chunks = device_chunks(count, batch * heads * index.shape[-1] * max(dim, v.shape[-1]), batch * heads)
    out = torch.cat([recomputed(_token_sdpa, q[:, :, r], k, v, index[:, r], chosen[:, r], call) for r in chunks], 2)
    return (out, None) if with_target else out


def _token_sdpa(q, k, v, index, chosen, call: AttentionCall) -> torch.Tensor:
    """Queries (B, H, C, D) over their selected keys in one SDPA call (off the CPU flash path)."""
    keys, values = (gather_rows(x, index) for x in (k, v))
    mask = (chosen | ~chosen.any(-1, keepdim=True))[:, None, :, None, :]  # a row without keys: zeroed below
    out = torch.nn.functional.scaled_dot_product_attention(
        q[..., None, :], keys, values, attn_mask=mask, dropout_p=call.effective_dropout, scale=call.scaling)
    return out[..., 0, :].masked_fill(~chosen.any(-1)[:, None, :, None], 0.0)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, n, D) at index (B, C, k') for every head: (B, H, C, k', D), read in place (a cache's view too)."""
    batch, heads, _, dim = x.shape
    rows, start, step = key_rows(x)
    picked = rows.index_select(0, (index[:, None] * step + start[:, :, None, None]).flatten())
    return picked.view(batch, heads, *index.shape[1:], dim)


def _flat(index: torch.Tensor, heads: int, n: int) -> torch.Tensor:
    """Rows of the (B·H·n, D) view of a (B, H, n, D) tensor at index (B, C, k') for every head: (B, H, C, k')."""
    start = torch.arange(index.shape[0] * heads, device=index.device).view(index.shape[0], heads, 1, 1) * n
    return index[:, None] + start


def query_chunks(q: torch.Tensor, count: int):
    """Query ranges whose gathered keys hold about ``limits.DSA_GATHER_CHUNK_ELEMENTS`` elements."""
    batch, heads, length, dim = q.shape
    step = max(1, limits.DSA_GATHER_CHUNK_ELEMENTS // max(1, batch * heads * count * dim))
    return [slice(start, min(start + step, length)) for start in range(0, length, step)]


class _TokenGathered(torch.autograd.Function):
    """Per chunk of queries, one index_select of the keys and one of the values (rows of the (B·H·n, D) views) and one
    flash problem per (query, head) over its k' keys; the backward gathers again and index-adds the gradients.
    Optionally the head-summed, L1-normalised probabilities (the indexer's KL target) from the same gathered keys."""

    @staticmethod
    def forward(ctx, q, k, v, index, chosen, scale, dropout: Dropout, with_target: bool):
        batch, heads, length, dim = q.shape
        if k.shape[-2] <= length * index.shape[-1]:  # more rows read than held: each head's keys contiguous (locality)
            k, v = k.contiguous(), v.contiguous()
        outs, lses, targets = [], [], []
        for number, rows in enumerate(query_chunks(q, index.shape[-1])):
            keys, values, mask, queries = _chunk_inputs(q, k, v, index, chosen, rows)
            out, lse = attention_forward(queries, keys, values, mask, scale, dropout.child(number))
            outs.append(out.view(batch, heads, -1, v.shape[-1]))
            lses.append(lse.reshape(batch, heads, -1))
            if with_target:
                targets.append(_target(queries, keys, chosen[:, rows], scale, batch, heads))
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        target = torch.cat(targets, 1) if with_target else None
        ctx.scale, ctx.dropout = scale, dropout
        ctx.save_for_backward(q, k, v, index, chosen, out, lse)
        if target is not None:
            ctx.mark_non_differentiable(target)
        return out, target

    @staticmethod
    def backward(ctx, grad, _):
        q, k, v, index, chosen, out, lse = ctx.saved_tensors
        batch, heads, n, _ = k.shape
        grad = grad.contiguous()
        grad_q = torch.empty_like(q)
        grad_k, grad_v = (x.new_zeros(x.shape) for x in (k, v))  # contiguous: rows for index_add_
        flat_k, flat_v = grad_k.view(-1, k.shape[-1]), grad_v.view(-1, v.shape[-1])
        buffers: dict[str, torch.Tensor] = {}
        for number, rows in enumerate(query_chunks(q, index.shape[-1])):
            keys, values, mask, queries = _chunk_inputs(q, k, v, index, chosen, rows)
            flat = (x[:, :, rows].reshape(-1, 1, 1, x.shape[-1]) for x in (grad, out))
            args = (next(flat), queries, keys, values, next(flat), lse[:, :, rows].reshape(-1, 1, 1), mask, ctx.scale)
            if ctx.dropout.p == 0.0 and q.dtype == torch.float32:
                gq, gk, gv = _one_query_backward(*args, buffers)
            else:
                gq, gk, gv = attention_backward(*args, ctx.dropout.child(number))
            grad_q[:, :, rows] = gq.view(batch, heads, -1, q.shape[-1])
            where = _flat(index[:, rows], heads, n).flatten()
            flat_k.index_add_(0, where, gk.view(where.shape[0], -1))
            flat_v.index_add_(0, where, gv.view(where.shape[0], -1))
        return grad_q, grad_k, grad_v, None, None, None, None, None


def _one_query_backward(grad, q, k, v, out, lse, mask, scale: float, buffers: dict[str, torch.Tensor]):
    """The flash backward of one query per entry (E, 1, 1, D) over its keys (E, 1, k', D), fp32, no dropout, in
    batched matrix-vector products: torch's CPU kernel spends most of such a call zero-filling fresh (E, k', D)
    gradients; here the key and value gradients are written into ``buffers`` reused by every chunk."""
    keys, values, query, grad, out = k[:, 0], v[:, 0], q[:, 0, 0], grad[:, 0, 0], out[:, 0, 0]
    scores = torch.bmm(keys, query[:, :, None]).squeeze(-1).mul_(scale)
    if mask is not None:
        scores += mask.view(scores.shape)
    probs = scores.sub_(lse.view(-1, 1)).exp_()  # rows without keys: exp(-inf) = 0, no gradient
    grad_probs = torch.bmm(values, grad[:, :, None]).squeeze(-1)
    grad_scores = grad_probs.sub_((grad * out).sum(-1, keepdim=True)).mul_(probs).mul_(scale)
    grad_q = torch.bmm(grad_scores[:, None, :], keys)
    shape = keys.shape
    if buffers.get("k") is None or buffers["k"].shape != shape:
        buffers["k"], buffers["v"] = keys.new_empty(shape), values.new_empty(values.shape)
    grad_k = torch.mul(grad_scores[:, :, None], query[:, None, :], out=buffers["k"])
    grad_v = torch.mul(probs[:, :, None], grad[:, None, :], out=buffers["v"])
    return grad_q.view(q.shape), grad_k, grad_v


def _chunk_inputs(q, k, v, index, chosen, rows: slice):
    """Gathered keys/values (B·H·C, 1, k', D), additive mask (B·H·C, 1, 1, k') or None (every slot chosen) and
    queries (B·H·C, 1, 1, D)."""
    batch, heads = q.shape[:2]
    keys, values = (gather_rows(x, index[:, rows]).flatten(0, 2)[:, None] for x in (k, v))
    ok = chosen[:, rows]
    mask = None
    if not bool(ok.all()):
        allowed = ok[:, None].expand(batch, heads, -1, -1).flatten(0, 2)[:, None, None, :]
        mask = additive_mask(allowed, q.dtype)
    return keys, values, mask, q[:, :, rows].reshape(-1, 1, 1, q.shape[-1])


def _target(queries, keys, ok, scale: float, batch: int, heads: int) -> torch.Tensor:
    """(B, C, k') fp32: the chunk's attention probabilities (no dropout) summed over heads and L1-normalised."""
    scores = torch.matmul(queries[:, 0].float(), keys[:, 0].float().transpose(-1, -2)).view(batch, heads, *ok.shape[1:])
    probs = torch.softmax((scores * scale).masked_fill(~ok[:, None], float("-inf")), -1).nan_to_num(0.0).sum(1)
    return probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)


def dsa_flops(n: int, heads: int, head_dim: int, index_heads: int, index_dim: int, top_k: int) -> float:
    """Forward FLOPs at length n (causal): the indexer over every earlier key and attention over min(top_k, t + 1)."""
    indexer = 2.0 * index_heads * index_dim * n * (n + 1) / 2
    ramp = min(n, top_k)  # the first queries read every earlier key
    keys = ramp * (ramp + 1) / 2 + (n - ramp) * top_k
    return indexer + 4.0 * heads * head_dim * keys
