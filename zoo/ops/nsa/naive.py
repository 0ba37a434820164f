"""NSA written out, the tests' oracles (O(n²) or slower, tests only): the paper's rule one query at a time
(:func:`nsa_naive`), and the three branches as dense softmaxes restricted to the kernel's own choice
(:func:`nsa_reference_branches`, the variant's ``reference``)."""

from __future__ import annotations

import torch

from zoo.call import AttentionCall
from zoo.ops.chosen_blocks import selected_blocks_mask
from zoo.ops.dense import softmax_attention
from zoo.ops.nsa.kernel import Compress, NSABlocks, span_parts


def nsa_naive(q, k, v, gates, padding_mask, compress_k: Compress, compress_v: Compress, geometry: NSABlocks):
    """The rule, one query at a time, over each row's real tokens (positions from its first one): q (B, H, n, D),
    k/v (B, H_kv, n, D), ``gates`` (B, n, H, 3) in (0, 1). Returns (B, H, n, Dv); padded query rows are left zero."""
    l, d, sel, top_n, w = geometry.compress, geometry.stride, geometry.select, geometry.top_n, geometry.window  # noqa: E741
    batch, heads, n, _ = q.shape
    groups, scale = heads // k.shape[1], q.shape[-1] ** -0.5
    mask = torch.ones(batch, n, dtype=torch.bool) if padding_mask is None else padding_mask
    out = torch.zeros_like(q)
    for b in range(batch):
        real = mask[b].nonzero()[:, 0]
        start, end = int(real[0]), int(real[-1]) + 1
        for g in range(k.shape[1]):
            keys, values = k[b, g, start:end], v[b, g, start:end]
            blocks = range((end - start - l) // d + 1) if end - start >= l else range(0)
            ck = [compress_k(keys[i * d : i * d + l]) for i in blocks]
            cv = [compress_v(values[i * d : i * d + l]) for i in blocks]
            heads_of = range(g * groups, (g + 1) * groups)
            for t in range(end - start):
                seen = [i for i in blocks if i * d + l - 1 <= t]
                probs = {h: torch.softmax(torch.stack([q[b, h, start + t] @ ck[i] for i in seen]) * scale, 0)
                         if seen else None for h in heads_of}
                own = t // sel
                score = {j: sum(float(probs[h][seen.index(i)].detach())
                                * len(set(range(i, i + l // d)) & set(range(j * sel // d, (j + 1) * sel // d)))
                                for h in heads_of for i in seen)
                         for j in range(own + 1)}
                forced = sorted({0, own, max(own - 1, 0)})
                rest = sorted((-score[j], j) for j in range(own + 1) if j not in forced)
                chosen = forced + [j for _, j in rest[: top_n - len(forced)]]
                picked = [s for j in chosen for s in range(j * sel, (j + 1) * sel) if s <= t]
                window = list(range(max(0, t - w + 1), t + 1))
                for h in heads_of:
                    o_cmp = probs[h] @ torch.stack([cv[i] for i in seen]) if seen else torch.zeros_like(values[0])
                    o_slc, o_win = (torch.softmax(keys[s] @ q[b, h, start + t] * scale, 0) @ values[s]
                                    for s in (picked, window))
                    gate = gates[b, start + t, h]
                    out[b, h, start + t] = gate[0] * o_cmp + gate[1] * o_slc + gate[2] * o_win
    return out


def nsa_reference_branches(
    q, k, v, call: AttentionCall, geometry: NSABlocks, compress_k: Compress, compress_v: Compress, groups: int
):
    """:func:`zoo.ops.nsa.nsa_branches` as three dense softmaxes restricted to the same compressed blocks, selected
    tokens and window (O(n²), tests only)."""
    keys, values, visible, blocks, chosen, positions = span_parts(
        q, k, v, call, geometry, compress_k, compress_v, groups
    )
    n = k.shape[-2]
    selected = selected_blocks_mask(blocks, chosen, geometry.select, n, positions, call.padding_mask)
    offset = positions[:, None] - torch.arange(n, device=q.device)
    window = (offset >= 0) & (offset < geometry.window)
    if call.padding_mask is not None:
        window = window & call.padding_mask[:, None, None, :]
    return (
        softmax_attention(q, keys, values, visible(slice(None)), call.scaling),
        softmax_attention(q, k, v, selected, call.scaling),
        softmax_attention(q, k, v, window, call.scaling),
    )
