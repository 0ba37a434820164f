"""``dilated_prefix``: a dilated sliding window plus the first ``prefix`` real tokens of each row, declared only as a
pattern with block hints -- no kernel: the zoo runs it on its chunked kernels, decodes with the derived cache and
counts its FLOPs from the same hints."""

from zoo import AttentionCall, Param, Variant
from zoo.pattern import Pattern, TokenSet, band, band_key_blocks, global_columns, or_masks

BLOCK = 64


class DilatedPrefixAttention(Variant):
    name = "dilated_prefix"
    exact = True
    time_complexity = "O(n·(w + p))"
    memory_complexity = "O(n·(w + p))"
    params = {
        "window": Param(64, int, "keys on each side (every dilation-th)", min=1),
        "dilation": Param(2, int, "gap between window keys", min=1),
        "prefix": Param(4, int, "first real tokens every query sees", min=0),
    }
    test_params = {"window": 5, "dilation": 2, "prefix": 3}

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int) -> Pattern:
        reach = self.window * self.dilation
        prefix = TokenSet(tuple(range(self.prefix)), row_start=call.row_start)
        rule = or_masks(band(reach, self.dilation), global_columns(prefix))
        return Pattern(rule, reach=reach, sinks=prefix, block_size=BLOCK,
                       key_blocks=band_key_blocks(reach, BLOCK, prefix))
