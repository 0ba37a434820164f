"""Each row over its own real tokens: kernels whose pattern is laid out from a row's first real token and its own
length (block boundaries, summary columns, BigBird's random layout) run once per distinct span of real tokens, so a
row's outputs do not depend on how much padding its batch adds (README, "Supported model families": padding).

A row's span is ``[first real key, last real key + 1)`` (left and right padding; padding inside the span stays in the
sliced padding mask). :func:`by_row_span` slices each group of rows with the same span to it, runs the kernel as if
the row stood alone (positions from 0, its own length) and puts the outputs back in place (padded query rows zero).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from zoo.call import AttentionCall

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionCall], torch.Tensor]


def row_spans(padding_mask: torch.Tensor | None, kv_len: int) -> list[tuple[int, int]] | None:
    """``[(start, end)]`` per batch row: its first real key and one past its last real key over ``kv_len`` keys;
    None when no row is padded (every span is ``(0, kv_len)``)."""
    if padding_mask is None:
        return None
    real = padding_mask.bool()
    if bool(real.all()):
        return None
    positions = torch.arange(real.shape[-1], device=real.device)
    starts = torch.where(real, positions, real.shape[-1]).amin(-1)
    ends = torch.where(real, positions + 1, 0).amax(-1)
    return [(int(s), int(e)) if e > s else (0, 0) for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]


def by_row_span(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """``kernel(q, k, v, call)`` run per group of rows with the same span of real keys, each sliced to its span (the
    queries are the last ``q_len`` keys; a query outside its row's span outputs zeros). One call when no row is
    padded. The kernel sees keys at positions 0 .. span - 1, ``row_start`` None and the padding inside the span."""
    q_len, kv_len = q.shape[-2], k.shape[-2]
    spans = row_spans(call.padding_mask, kv_len)
    if spans is None or (call.positions is not None and not torch.equal(
            call.positions, torch.arange(kv_len, device=call.positions.device))):
        return kernel(q, k, v, call)
    groups: dict[tuple[int, int], list[int]] = {}
    for row, span in enumerate(spans):
        groups.setdefault(span, []).append(row)
    first_query = kv_len - q_len
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    for (start, end), rows in groups.items():
        low = max(first_query, start)
        if end <= low:  # no real query in this span
            continue
        index = torch.tensor(rows, device=q.device)
        if len(rows) == q.shape[0]:
            pick = slice(None)
        elif rows == list(range(rows[0], rows[-1] + 1)):
            pick = slice(rows[0], rows[-1] + 1)
        else:
            pick = index
        mask = call.padding_mask[pick, start:end]
        sub = dataclasses.replace(
            call, padding_mask=None if bool(mask.all()) else mask, row_start=None, positions=None,
            decoding=call.decoding and end - low < end - start,
        )
        piece = kernel(q[pick, :, low - first_query : end - first_query], k[pick, :, start:end],
                       v[pick, :, start:end], sub)
        if isinstance(pick, slice):
            out[pick, :, low - first_query : end - first_query] = piece
        else:
            out[index, :, low - first_query : end - first_query] = piece
    return out
