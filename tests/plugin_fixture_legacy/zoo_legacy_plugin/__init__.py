"""A plugin written from attention-zoo 0.1.0's README, and two that crash when asked for their pattern or cache."""

from zoo import AttentionCall, Param, Variant
from zoo.ops import allowed_mask, softmax_attention


class LegacyBandAttention(Variant):
    """Plugin API 1: ``pattern()`` returns the bare predicate ``(b, h, q_idx, kv_idx) -> bool``."""

    name = "legacy_band"
    exact = True
    supports_dropout = False
    time_complexity, memory_complexity = "O(n²)", "O(n²)"
    params = {"width": Param(16, int, "|q - kv| <= width", min=0)}
    test_params = {"width": 8}

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int):
        width = self.width
        return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= width

    def attend(self, q, k, v, call: AttentionCall):
        pattern = self.pattern(call, q.shape[-2], k.shape[-2])
        allowed = allowed_mask(call, pattern, q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], q.device)
        return softmax_attention(q, k, v, allowed, call.scaling)


class RaisingPatternAttention(LegacyBandAttention):
    name = "raising_pattern"

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int):
        raise RuntimeError("raising_pattern: pattern() is broken on purpose")


class RaisingCacheAttention(LegacyBandAttention):
    name = "raising_cache"

    def cache_layer(self, layer_idx: int, config):
        raise RuntimeError("raising_cache: cache_layer() is broken on purpose")
