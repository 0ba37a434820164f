"""Block-sparse attention computed by key block (MoBA's and NSA's selected blocks on CPU).

Each query reads its own block of ``block`` keys (causal inside it) and some chosen complete blocks before it, in
one softmax. Rather than gathering every query's keys, the work is grouped by key block: one flash call runs all
own blocks at once (causal), then the queries that chose a key block form that block's group, and groups of similar
size run together, padded to the batch's largest, one flash call per batch (:meth:`KeyBlockGroups.batches`): a
call per group cost more in its overheads than in its arithmetic (NSA at 16K: 3,072 groups of 64 keys). The parts
merge through their log-sum-exps into running fp32 accumulators (extra memory O(n·heads·d), not one slot per chosen
block). The backward recomputes each part from the merged output and log-sum-exp (as :mod:`zoo.ops.union`). A
selection shared by the ``G`` query heads of a KV head (NSA's GQA groups) runs those heads together: G·m queries over
the KV head's block, so each block is read once per group. Under attention dropout each group runs alone on
:mod:`zoo.ops.dropout`'s kernels (its masks seeded by the group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.call import AttentionCall
from zoo.ops import limits
from zoo.ops.dense import pad_to_multiple
from zoo.ops.dropout import Dropout, attention_backward, attention_forward
from zoo.ops.flash import additive_mask, flash_available, flash_backward, flash_forward


class KeyBlockGroups:
    """The queries of each (part, key block) with part = row·KV head: ``keys`` (K,) the flat key block p·nb + j of
    each non-empty group, ``rows`` the flat rows (part·nb·G·block + the row in :func:`to_layout`'s layout) of every
    group's queries, G heads each, sorted by group, ``bounds`` (K + 1,) the offsets of each group's rows."""

    SLACK = 1.25  # a batch of groups holds at most this many padded rows per real one

    def __init__(self, keys: torch.Tensor, rows: torch.Tensor, bounds: torch.Tensor) -> None:
        self.keys, self.rows, self.bounds = keys, rows, bounds

    def batches(self, width: int, one_each: bool):
        """(number, keys (c,), rows (c, M), valid (c, M) bool) per batch of groups, one flash call each: a group alone
        (``one_each``: the dropout kernels seed each group's call by its ``number``), else groups of similar size,
        largest first, each padded to the batch's first (``valid`` False; its row any real one), at most
        ``limits.KEY_BLOCK_BATCH_ELEMENTS`` query elements of ``width`` a batch and :attr:`SLACK` padding."""
        sizes = self.bounds[1:] - self.bounds[:-1]
        order = range(len(sizes)) if one_each else sizes.argsort(descending=True, stable=True).tolist()
        counts, batch, real, longest = sizes.tolist(), [], 0, 0
        for group in order:
            size = counts[group]
            if batch and (
                one_each
                or (len(batch) + 1) * longest * width > limits.KEY_BLOCK_BATCH_ELEMENTS
                or (len(batch) + 1) * longest > self.SLACK * (real + size)
            ):
                yield self._batch(batch, longest)
                batch, real = [], 0
            if not batch:
                longest = size
            batch.append(group)
            real += size
        if batch:
            yield self._batch(batch, longest)

    def _batch(self, groups: list[int], longest: int):
        chosen = torch.tensor(groups, device=self.rows.device)
        offsets = torch.arange(longest, device=self.rows.device)
        valid = offsets < (self.bounds[chosen + 1] - self.bounds[chosen])[:, None]
        rows = self.rows[(self.bounds[chosen][:, None] + offsets).clamp_(max=len(self.rows) - 1)]
        return groups[0], self.keys[chosen], rows, valid


def by_key_block(blocks: torch.Tensor, chosen: torch.Tensor, block: int, heads: int) -> KeyBlockGroups:
    """Group the chosen (query, slot) pairs of blocks/chosen (B, H_kv, n, R) by (row·KV head, key block); each pair
    stands for its query in the ``heads`` query heads that share the selection (:func:`to_layout`'s rows)."""
    nb = -(-blocks.shape[-2] // block)
    flat_blocks, flat_chosen = blocks.flatten(0, 1), chosen.flatten(0, 1)
    parts, queries, slots = flat_chosen.nonzero(as_tuple=True)
    keys = parts * nb + flat_blocks[parts, queries, slots]
    order = keys.argsort(stable=True)
    keys, parts, queries = keys[order], parts[order], queries[order]
    base = parts * (nb * heads * block) + queries // block * (heads * block) + queries % block
    rows = (base[:, None] + torch.arange(heads, device=blocks.device) * block).flatten()
    distinct, counts = torch.unique_consecutive(keys, return_counts=True)
    bounds = torch.cat([counts.new_zeros(1), (counts * heads).cumsum(0)])
    return KeyBlockGroups(distinct, rows, bounds)


def to_layout(x: torch.Tensor, kv_heads: int, block: int) -> torch.Tensor:
    """(B, H, n, D) -> (B·H_kv, nb, G·block, D): each KV head's G query heads side by side within each block."""
    batch, heads, _, dim = x.shape
    x = pad_to_multiple(x, block).unflatten(1, (kv_heads, heads // kv_heads)).unflatten(3, (-1, block))
    return x.permute(0, 1, 3, 2, 4, 5).reshape(batch * kv_heads, -1, heads // kv_heads * block, dim)


def from_layout(x: torch.Tensor, batch: int, heads: int, n: int, block: int) -> torch.Tensor:
    """The inverse of :func:`to_layout`: (B·H_kv, nb, G·block, D) -> (B, H, n, D)."""
    parts, nb, _, dim = x.shape
    x = x.view(batch, parts // batch, nb, heads * batch // parts, block, dim).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(batch, heads, nb * block, dim)[:, :, :n]


def by_key_block_applies(q: torch.Tensor, k: torch.Tensor, call: AttentionCall) -> bool:
    """Whether :func:`block_grouped_attention` takes this call of one row span: the CPU flash kernels take q's dtype,
    no padding inside the span, as many queries as keys. MoBA and NSA's selected branch decide here."""
    return flash_available(q) and call.padding_mask is None and q.shape[-2] == k.shape[-2]


def block_grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    chosen: torch.Tensor,
    block: int,
    scale: float,
    dropout: Dropout,
) -> torch.Tensor:
    """Causal attention of each query over its own block and its chosen earlier blocks (CPU flash kernels).

    q (B, H, n, D) at positions 0 .. n - 1; k/v (B, H_kv, n, D) with H = G·H_kv; blocks/chosen (B, H_kv, n, R):
    the earlier blocks (strictly before the query's own) each query reads, shared by the G query heads of its KV
    head, each named at most once. No padding. Returns (B, H, n, Dv)."""
    batch, heads, n, _ = q.shape
    kv_heads = k.shape[1]
    picked = by_key_block(blocks, chosen, block, heads // kv_heads)
    keys, values = (pad_to_multiple(x, block).unflatten(-2, (-1, block)).flatten(0, 1) for x in (k, v))
    out = _BlockGrouped.apply(scale, picked, dropout, to_layout(q, kv_heads, block), keys, values)
    return from_layout(out, batch, heads, n, block)


def _causal(q: torch.Tensor, block: int) -> torch.Tensor:
    """The own blocks' additive mask (G·block, block): causal within the block for each of the G heads."""
    heads = q.shape[2] // block
    return additive_mask(torch.ones(block, block, dtype=torch.bool, device=q.device).tril().repeat(heads, 1), q.dtype)


def _own_blocks_forward(q, k, v, scale: float, dropout: Dropout):
    """Each query block over its own key block, causal: the kernel's own causal tiles where one head fills the block
    (no mask, the tiles above the diagonal skipped), else :func:`_causal`'s mask for the G heads side by side."""
    if dropout.p == 0.0 and q.shape[2] == k.shape[2]:
        return flash_forward(q, k, v, None, scale, causal=True)
    return attention_forward(q, k, v, _causal(q, k.shape[2]), scale, dropout.child(0))


def _own_blocks_backward(grad, q, k, v, out, lse, scale: float, dropout: Dropout):
    if dropout.p == 0.0 and q.shape[2] == k.shape[2]:
        return flash_backward(grad, q, k, v, out, lse, None, scale, causal=True)
    return attention_backward(grad, q, k, v, out, lse, _causal(q, k.shape[2]), scale, dropout.child(0))


class _BlockGrouped(torch.autograd.Function):
    """q (P, nb, G·block, D) in :func:`to_layout`'s layout, k/v (P, nb, block, D): own blocks causal in one call,
    the chosen key blocks with their queries in batches of groups (:meth:`KeyBlockGroups.batches`), merged by
    log-sum-exp; the backward recomputes (padded rows: no gradient and, with an infinite log-sum-exp, no
    probability)."""

    @staticmethod
    def forward(ctx, scale, picked: KeyBlockGroups, dropout: Dropout, q, k, v):
        dim, dv = q.shape[-1], v.shape[-1]
        own_out, own_lse = _own_blocks_forward(q, k, v, scale, dropout)
        merge = _Merge(own_out.reshape(-1, dv), own_lse.reshape(-1))
        flat_q, flat_k, flat_v = q.reshape(-1, dim), k.flatten(0, 1), v.flatten(0, 1)
        for number, keys, rows, valid in picked.batches(dim, dropout.p > 0):
            out, lse = attention_forward(
                flat_q.index_select(0, rows.flatten()).view(*rows.shape, dim)[:, None],
                flat_k.index_select(0, keys)[:, None],
                flat_v.index_select(0, keys)[:, None],
                None,
                scale,
                dropout.child(1, number),
            )
            lse = lse[:, 0].masked_fill_(~valid, float("-inf"))  # padded rows: weight 0, whatever row they name
            merge.add(rows.flatten(), out.flatten(0, 2), lse.flatten())
        merged, total = merge.result(q.dtype)
        merged, total = merged.view(*q.shape[:-1], dv), total.view(q.shape[:-1])
        ctx.scale, ctx.picked, ctx.dropout = scale, picked, dropout
        ctx.save_for_backward(q, k, v, merged, total)
        return merged

    @staticmethod
    def backward(ctx, grad):
        q, k, v, merged, total = ctx.saved_tensors
        scale, dim, dv = ctx.scale, q.shape[-1], v.shape[-1]
        grad = grad.contiguous()
        grad_q, grad_k, grad_v = _own_blocks_backward(grad, q, k, v, merged, total, scale, ctx.dropout)
        grad_q, grad_k, grad_v = (x.contiguous() for x in (grad_q, grad_k, grad_v))
        flat_q, flat_grad, flat_out = q.reshape(-1, dim), grad.view(-1, dv), merged.view(-1, dv)
        flat_total, flat_k, flat_v = total.view(-1), k.flatten(0, 1), v.flatten(0, 1)
        flat_grad_q, flat_grad_k, flat_grad_v = grad_q.view(-1, dim), grad_k.flatten(0, 1), grad_v.flatten(0, 1)
        for number, keys, rows, valid in ctx.picked.batches(dim, ctx.dropout.p > 0):
            index, shape = rows.flatten(), (rows.shape[0], 1, rows.shape[1])
            got_grad, lse = flat_grad.index_select(0, index).view(*shape, dv), flat_total.index_select(0, index)
            if not bool(valid.all()):  # padded rows: no gradient and, with an infinite log-sum-exp, no probability
                got_grad *= valid.view(*shape, 1)
                lse = lse.masked_fill_(~valid.flatten(), float("inf"))
            gq, gk, gv = attention_backward(
                got_grad,
                flat_q.index_select(0, index).view(*shape, dim),
                flat_k.index_select(0, keys)[:, None],
                flat_v.index_select(0, keys)[:, None],
                flat_out.index_select(0, index).view(*shape, dv),
                lse.view(shape),
                None,
                scale,
                ctx.dropout.child(1, number),
            )
            flat_grad_q.index_add_(0, index, gq.flatten(0, 2))  # padded rows' gradients are zeros
            flat_grad_k.index_add_(0, keys, gk[:, 0])
            flat_grad_v.index_add_(0, keys, gv[:, 0])
        return None, None, None, grad_q, grad_k, grad_v


class _Merge:
    """Running softmax parts per row (flat) in fp32: Σ weight·out and Σ weight with weight = exp(lse - base),
    ``base`` (first the own part's log-sum-exp) raised for a row when a part's log-sum-exp passes it by more than
    HEADROOM, so no weight overflows and the largest is at least exp(-HEADROOM)."""

    HEADROOM = 30.0

    def __init__(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """The first part's outputs (m, Dv) and log-sum-exps (m,), taken over (fp32 ones are written in place)."""
        self.sums = out.float()
        self.base = lse.float()
        self.mass = torch.ones_like(self.base)

    def add(self, index: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Add parts' outputs (m, Dv) and log-sum-exps (m,) to rows ``index`` (m,), a row possibly more than once."""
        shift = lse - self.base.index_select(0, index)
        high = shift > self.HEADROOM
        if bool(high.any()):  # raise each such row's base to its largest log-sum-exp, rescaling what it holds
            raised = self.base.scatter_reduce(0, index[high], lse[high].float(), "amax")
            rows = index[high].unique()
            factor = torch.exp(self.base.index_select(0, rows) - raised.index_select(0, rows))
            self.sums.index_copy_(0, rows, self.sums.index_select(0, rows) * factor[:, None])
            self.mass.index_copy_(0, rows, self.mass.index_select(0, rows) * factor)
            self.base = raised
            shift = lse - self.base.index_select(0, index)
        weight = torch.exp(shift)
        self.sums.index_add_(0, index, out.float() * weight[:, None])
        self.mass.index_add_(0, index, weight)

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(merged outputs in ``dtype``, log-sum-exps fp32)."""
        return self.sums.div_(self.mass[..., None]).to(dtype), self.base.add_(self.mass.log())  # once, at the end


def band_attention(q, k, v, width: int, block: int, scale: float, dropout: Dropout) -> torch.Tensor:
    """Causal sliding window (0 <= t - s < ``width``) on the CPU flash kernels. q (B, H, n, D), k/v (B, H_kv, n, D)
    (H = G·H_kv), no padding. Returns (B, H, n, Dv).

    Each query block (the G heads of a KV head together) reads one contiguous run of keys, the ``front`` blocks
    before it and its own, as an overlapping strided view of the keys (no gather): one flash call per chunk of
    blocks under one shared band mask (the first blocks' own, so no key before position 0 counts); the backward
    recomputes and folds the key gradients of the overlapping runs back."""
    batch, heads, n, dim = q.shape
    front, nb = -(-width // block), -(-n // block)
    keys, values = (F.pad(x, (0, 0, front * block, nb * block - n)).flatten(0, 1) for x in (k, v))
    plan = _BandPlan(width, front, block, nb, heads // k.shape[1], keys.shape[0], dim, q)
    out = ChunkedFlash.apply(plan, scale, dropout, to_layout(q, k.shape[1], block), keys, values)
    return from_layout(out, batch, heads, n, block)


class ChunkedFlash(torch.autograd.Function):
    """Attention chunk by chunk on the flash kernels, each chunk's keys and mask made by a ``plan`` when the chunk
    runs (forward and backward, never all at once); outputs and log-sum-exps kept, each chunk recomputed in the
    backward. ``plan.chunks()`` -> chunks; ``plan.pieces(chunk, keys, values)`` -> (where: q's rows as an index
    tuple, keys, values, additive mask) or None (no key: zero output); ``plan.fold(chunk, grad, piece_grad)`` adds a
    chunk's key (or value) gradients into the gradient of ``keys`` (or ``values``)."""

    @staticmethod
    def forward(ctx, plan, scale: float, dropout: Dropout, q, keys, values):
        out = q.new_zeros(*q.shape[:-1], values.shape[-1])
        lse = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
        for number, chunk in enumerate(plan.chunks()):
            pieces = plan.pieces(chunk, keys, values)
            if pieces is not None:
                where, k, v, mask = pieces
                out[where], lse[where] = attention_forward(q[where], k, v, mask, scale, dropout.child(number))
        ctx.plan, ctx.scale, ctx.dropout = plan, scale, dropout
        ctx.save_for_backward(q, keys, values, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, keys, values, out, lse = ctx.saved_tensors
        plan = ctx.plan
        grad = grad.contiguous()
        grad_q, grad_keys, grad_values = torch.zeros_like(q), torch.zeros_like(keys), torch.zeros_like(values)
        for number, chunk in enumerate(plan.chunks()):
            pieces = plan.pieces(chunk, keys, values)
            if pieces is None:
                continue
            where, k, v, mask = pieces
            gq, gk, gv = attention_backward(
                grad[where], q[where], k, v, out[where], lse[where], mask, ctx.scale, ctx.dropout.child(number)
            )
            grad_q[where] = gq
            plan.fold(chunk, grad_keys, gk)
            plan.fold(chunk, grad_values, gv)
        return None, None, None, grad_q, grad_keys, grad_values


class _BandPlan:
    """:func:`band_attention`'s chunks: ranges of query blocks over their runs of keys (P, (front + nb)·block, D),
    the first ``front`` blocks alone (their own masks), then about ``limits.RUN_CHUNK_ELEMENTS`` key elements a
    chunk."""

    def __init__(self, width: int, front: int, block: int, nb: int, heads: int, parts: int, dim: int, like) -> None:
        self.front, self.block, self.nb, self.span = front, block, nb, (front + 1) * block
        self.step = max(1, limits.RUN_CHUNK_ELEMENTS // (parts * self.span * dim))
        rows, cols = torch.arange(block, device=like.device)[:, None], torch.arange(self.span, device=like.device)
        distance = rows + front * block - cols  # t - s
        allowed = ((distance >= 0) & (distance < width)).repeat(heads, 1)  # rows repeated for the G heads
        first = allowed & (cols >= (front - torch.arange(front, device=like.device)[:, None, None]) * block)
        self.shared, self.first = additive_mask(allowed, like.dtype)[None, None], additive_mask(first, like.dtype)[None]

    def chunks(self):
        first = min(self.front, self.nb)
        return [(0, first)] * (first > 0) + [(a, min(a + self.step, self.nb)) for a in range(first, self.nb, self.step)]

    def pieces(self, chunk, keys, values):
        start, stop = chunk
        mask = self.first[:, start:stop] if start < self.front else self.shared
        return (slice(None), slice(start, stop)), self._runs(keys, chunk), self._runs(values, chunk), mask

    def fold(self, chunk, grad, piece_grad) -> None:
        start, stop = chunk
        for offset in range(self.front + 1):  # the runs overlap: run i's offset-th block is key block i + offset
            rows = slice((start + offset) * self.block, (stop + offset) * self.block)
            grad[:, rows] += piece_grad[:, :, offset * self.block : (offset + 1) * self.block].flatten(1, 2)

    def _runs(self, x: torch.Tensor, chunk) -> torch.Tensor:
        """Runs of query blocks start .. stop - 1 as a view (P, stop - start, span, D): run i starts at i·block."""
        (start, stop), dim = chunk, x.shape[-1]
        return x.as_strided(
            (x.shape[0], stop - start, self.span, dim),
            (x.stride(0), self.block * dim, dim, 1),
            x.storage_offset() + start * self.block * dim,
        )
