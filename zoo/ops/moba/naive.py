"""MoBA's rule written out, the tests' oracle: one query at a time, blocks counted from the row's first real token,
the gate of each complete earlier block ``q · mean(its real keys)``, the ``top_k`` best gates (ties to the earlier
block) plus the query's own block up to the query (:func:`moba_naive_mask`, :func:`moba_naive`); and the dense mask
of the keys the kernel's own selection names (:func:`moba_allowed`, the variant's ``reference``). O(n²), tests only.
"""

from __future__ import annotations

import torch

from zoo.call import AttentionCall
from zoo.ops.chosen_blocks import selected_blocks_mask
from zoo.ops.dense import softmax_attention
from zoo.ops.moba.kernel import moba_selection


def moba_naive_mask(q, k, padding_mask: torch.Tensor | None, block: int, top_k: int) -> torch.Tensor:
    """(B, H, n, n) bool: the keys each query reads by the paper's rule, a Python loop per query (fp64 gates)."""
    batch, heads, n, _ = q.shape
    mask = torch.ones(batch, n, dtype=torch.bool) if padding_mask is None else padding_mask
    allowed = torch.zeros(batch, heads, n, n, dtype=torch.bool)
    for b in range(batch):
        start = int(mask[b].float().argmax())
        for h in range(heads):
            for t in range(start, n):
                own = (t - start) // block
                gates = []
                for j in range(own):
                    keys = [s for s in range(start + j * block, start + (j + 1) * block) if mask[b, s]]
                    if keys:
                        mean = k[b, h, keys].detach().double().mean(0)
                        gates.append((-float(q[b, h, t].detach().double() @ mean), j))
                for _, j in sorted(gates)[:top_k]:
                    allowed[b, h, t, start + j * block : start + (j + 1) * block] = True
                allowed[b, h, t, start + own * block : t + 1] = True
    return allowed & mask[:, None, None, :]


def moba_naive(q, k, v, padding_mask: torch.Tensor | None, block: int, top_k: int, scale: float) -> torch.Tensor:
    """(B, H, n, Dv): softmax attention over :func:`moba_naive_mask`'s keys, padded query rows zero."""
    out = softmax_attention(q, k, v, moba_naive_mask(q, k, padding_mask, block, top_k), scale)
    return out if padding_mask is None else out.masked_fill(~padding_mask[:, None, :, None], 0.0)


def moba_allowed(q: torch.Tensor, k: torch.Tensor, call: AttentionCall, block: int, top_k: int) -> torch.Tensor:
    """The dense (B, H, Q, n) bool mask of the keys :func:`zoo.ops.moba.moba_attention` reads in one row span."""
    blocks, chosen, positions = moba_selection(q, k, call, block, top_k)
    return selected_blocks_mask(blocks, chosen, block, k.shape[-2], positions, call.padding_mask)
