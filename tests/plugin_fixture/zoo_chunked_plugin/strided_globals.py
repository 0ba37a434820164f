"""``strided_globals``: a band, global columns every ``period`` tokens counted from each row's first real token and
``prefix`` sinks, declared only as a pattern with block hints -- no kernel. Its key blocks grow with n (the columns
reach back to the start), so the shared pattern kernel must stay O(n · keys per query) for any hints (issue 29)."""

import torch

from zoo import AttentionCall, Param, Variant
from zoo.pattern import Pattern, TokenSet, band, global_columns, or_masks

BLOCK = 16


class StridedGlobalsAttention(Variant):
    name = "strided_globals"
    exact = True
    time_complexity = "O(n·(w + n/p))"
    memory_complexity = "O(n·(w + n/p))"
    params = {
        "reach": Param(256, int, "keys on each side", min=1),
        "period": Param(64, int, "a global column every period tokens from the row's first real token", min=1),
        "prefix": Param(2, int, "first real tokens every query sees", min=0),
    }
    test_params = {"reach": 6, "period": 8, "prefix": 2}

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int) -> Pattern:
        prefix = TokenSet(tuple(range(self.prefix)), row_start=call.row_start)
        period, row_start = self.period, call.row_start

        def columns(b, h, q_idx, kv_idx):
            start = 0 if row_start is None else row_start[0 if b is None or row_start.shape[0] == 1 else b]
            return (kv_idx - start) % period == 0

        starts = sorted(set(row_start.tolist())) if row_start is not None else [0]
        column_blocks = torch.tensor(sorted({(start + p) // BLOCK for start in starts
                                             for p in range(0, max(kv_len - start, 1), period)}))
        side = -(-self.reach // BLOCK)
        around = torch.arange(-side, side + 1)
        sink_blocks = torch.arange(-(-(prefix.last_position() + 1) // BLOCK)) if prefix else torch.zeros(0).long()

        def key_blocks(query_blocks: torch.Tensor) -> torch.Tensor:
            fixed = torch.cat([sink_blocks, column_blocks]).to(query_blocks.device)
            return torch.cat([fixed.expand(len(query_blocks), -1), query_blocks[:, None] + around], -1)

        # no reach: its columns reach back to the start, so decoding keeps every key (the default cache)
        return Pattern(or_masks(band(self.reach), global_columns(prefix), columns), block_size=BLOCK,
                       key_blocks=key_blocks)
