"""``xformers``: exact softmax attention through ``xformers.ops.memory_efficient_attention`` on CUDA tensors, with
torch SDPA (same semantics) everywhere else.

``window`` w (default None = full attention): query i sees key j when ``|i − j| < w`` (causal: ``0 ≤ i − j < w``,
xformers' ``window_size``: w keys, itself included). Padded batches are packed so no compute goes to pad tokens;
cases xformers cannot take fall back to torch, and one INFO log per backend (and reason) says which ran. Decoding
with a window keeps the last ``window − 1`` keys (:class:`zoo.cache.WindowedLayer`); without one, every key.

Which path runs when, and why: docs/notes/variants.md#xformers
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F

from zoo.cache import WindowedLayer
from zoo.ops import (
    allowed_mask,
    band_part,
    pad_to_multiple,
    sdpa_real_tokens_first,
    selected_attention,
    union_attention,
)
from zoo.pattern import Pattern, band
from zoo.variant import AttentionCall, Param, Variant

logger = logging.getLogger(__name__)

BAND_BLOCK = 64  # query block of the torch windowed path (at most; smaller windows use smaller blocks)


class XFormersAttention(Variant):
    name = "xformers"
    exact = True
    time_complexity = "O(n²); O(n·w) with a window"
    memory_complexity = "O(n)"
    params = {
        "window": Param(None, int, "local attention: |i − j| < window (causal: the window last tokens); None = full",
                        min=1, optional=True),
    }
    test_params = {"window": 16}

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int) -> Pattern | None:
        """``|i − j| < window`` (a band of reach window − 1), or every key without a window."""
        return None if self.window is None else Pattern(band(self.window - 1), reach=self.window - 1, plain_window=True)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        if self.window is None:
            return super().flops(n, heads, head_dim, causal)
        keys = min(n, self.window if causal else 2 * self.window - 1)
        return 4.0 * n * keys * heads * head_dim

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if call.decoding and isinstance(call.cache, WindowedLayer):  # a few queries over the kept window keys
            log_backend_once("zoo.ops.selected_attention", "decoding with the windowed cache")
            layer, first = call.cache, call.cache.seen - q.shape[-2]  # the queries are the tokens just appended
            pattern = layer.decoding_pattern(self, call.layer_idx, call.extra, call.row_start, call)
            return selected_attention(q, k, v, call, lambda rows: layer.select(first + rows.start,
                                                                                first + rows.stop - 1), pattern)
        reason = xformers_unavailable_reason(q)
        if reason is None:
            try:
                out = xformers_attention(q, k, v, call, self.window)
                log_backend_once("xformers memory_efficient_attention", "CUDA tensors and xformers installed")
                return out
            except TorchPathNeeded as exc:
                reason = str(exc)
            except NotImplementedError as exc:  # xformers found no operator for these inputs
                reason = f"xformers has no operator for these inputs ({str(exc).splitlines()[0]})"
        log_backend_once("torch scaled_dot_product_attention", reason)
        return torch_attention(q, k, v, call, self.window)



class TorchPathNeeded(Exception):
    """xformers cannot express this call; the message says why (it goes into the backend log)."""


def log_backend_once(backend: str, reason: str) -> None:
    if not torch.compiler.is_compiling():  # a compiled graph would break at the (cached) logging call
        _log_backend(backend, reason)


@functools.cache
def _log_backend(backend: str, reason: str) -> None:
    logger.info("attention-zoo variant 'xformers' runs on %s (%s).", backend, reason)


log_backend_once.cache_clear = _log_backend.cache_clear  # tests forget what was logged


def xformers_unavailable_reason(q: torch.Tensor) -> str | None:
    """None when the xformers kernel can run on ``q``, else why not (CUDA is checked first: no import on CPU)."""
    if q.device.type != "cuda":
        return f"tensors are on {q.device.type}; xformers' kernels need CUDA"
    if importlib.util.find_spec("xformers") is None:
        return "xformers is not installed (pip install xformers)"
    try:
        import xformers.ops  # noqa: F401
    except Exception as exc:  # a broken build must not break the model
        return f"import xformers.ops failed: {exc}"
    return None


# -------------------------------------------------------------------------------------------------------
# xformers path


def xformers_attention(q, k, v, call: AttentionCall, window: int | None, attention=None) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, N, D) through ``attention`` (default ``xformers.ops.memory_efficient_attention``,
    called as ``attention(q, k, v, attn_bias=..., p=..., scale=...)`` on (batch, seq, heads, dim) tensors; a
    stand-in, as the CPU tests use, skips the dtype rule of xformers' own kernels)."""
    local_bidirectional = window is not None and not call.causal
    if attention is None:
        if local_bidirectional and q.dtype not in (torch.float16, torch.bfloat16):
            raise TorchPathNeeded("a bidirectional window in xformers needs fp16/bf16 (only its flash kernels)")
        from xformers.ops import memory_efficient_attention as attention
    kwargs = {"p": call.effective_dropout, "scale": call.scaling}
    q_len, kv_len = q.shape[-2], k.shape[-2]
    real = call.padding_mask
    if real is not None and bool(real.all()):
        real = None
    if real is None and (q_len != kv_len or window is None or local_bidirectional):
        bias = xformers_bias(call.causal, window, q_len=q_len, kv_len=kv_len)
        return attention(*(_to_bmhk(x) for x in (q, k, v)), attn_bias=bias, **kwargs).transpose(1, 2)
    if q_len != kv_len:
        raise TorchPathNeeded("KV-cache step over a padded batch")
    # packed: padding, or a causal window (its block-diagonal bias is the one with fp32 backward kernels)
    real = real if real is not None else torch.ones(q.shape[0], q_len, dtype=torch.bool, device=q.device)
    lengths = real.sum(-1)
    if window is not None and not _rows_are_contiguous(real, lengths):
        raise TorchPathNeeded("a window over rows whose padding is not only a prefix or suffix")
    if local_bidirectional:
        return _per_row_local(q, k, v, real, lengths, window, attention, kwargs)
    seqlens = [int(n) for n in lengths.tolist() if n > 0]
    bias = xformers_bias(call.causal, window, seqlens=seqlens, device=q.device)
    packed = attention(*(pack_real_tokens(x, real) for x in (q, k, v)), attn_bias=bias, **kwargs)
    return unpack_real_tokens(packed, real, q.shape)


def xformers_bias(causal: bool, window: int | None, seqlens=None, q_len: int = 0, kv_len: int = 0, device=None):
    """The ``attn_bias`` for one call: of the whole batch (``seqlens`` None) or of the packed real tokens."""
    from xformers.ops.fmha import attn_bias

    if seqlens is not None:
        if window is not None and not causal:
            raise TorchPathNeeded("no packed bidirectional local bias with a backward kernel in xformers")
        packed = attn_bias.BlockDiagonalMask.from_seqlens(seqlens, device=device)
        if not causal:
            return packed
        return packed.make_local_attention(window) if window is not None else packed.make_causal()
    if causal:
        if window is not None:  # bottom-right alignment: the queries are the last q_len positions
            return attn_bias.LowerTriangularFromBottomRightLocalAttentionMask(window)
        if q_len == kv_len:
            return attn_bias.LowerTriangularMask()
        return attn_bias.LowerTriangularFromBottomRightMask()
    if window is not None:
        return attn_bias.LocalAttentionFromBottomRightMask(window_left=window - 1, window_right=window - 1)
    return None


def _to_bmhk(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) -> xformers' (batch, seq, heads, dim) layout, contiguous (what every operator accepts)."""
    return x.transpose(1, 2).contiguous()


def pack_real_tokens(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) -> (1, total real tokens, H, D), rows one after the other, positions in order."""
    return x.transpose(1, 2)[real].unsqueeze(0)


def unpack_real_tokens(packed: torch.Tensor, real: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The inverse of :func:`pack_real_tokens`; padded positions are zeros."""
    batch, heads, n, dim = shape
    out = packed.new_zeros(batch, n, heads, dim)
    out[real] = packed[0]
    return out.transpose(1, 2)


def _rows_are_contiguous(real: torch.Tensor, lengths: torch.Tensor) -> bool:
    """True when every row's real tokens form one span (padding only as a prefix and/or suffix)."""
    positions = torch.arange(real.shape[-1], device=real.device)
    first = torch.where(real, positions, real.shape[-1]).amin(-1)
    last = torch.where(real, positions, -1).amax(-1)
    return bool(((last - first + 1 == lengths) | (lengths == 0)).all())


def _per_row_local(q, k, v, real, lengths, window: int, attention, kwargs) -> torch.Tensor:
    """Bidirectional window over a padded batch: one call per row on its real span, zeros elsewhere."""
    from xformers.ops.fmha import attn_bias

    bias = attn_bias.LocalAttentionFromBottomRightMask(window_left=window - 1, window_right=window - 1)
    n = q.shape[-2]
    firsts = torch.where(real, torch.arange(n, device=real.device), n).amin(-1).tolist()
    rows = []
    for b, (first, length) in enumerate(zip(firsts, lengths.tolist(), strict=True)):
        span = slice(first, first + length)
        if length == 0:
            rows.append(q.new_zeros(q.shape[1:]))
            continue
        out = attention(*(_to_bmhk(x[b : b + 1, :, span]) for x in (q, k, v)), attn_bias=bias, **kwargs)
        rows.append(F.pad(out[0].transpose(0, 1), (0, 0, first, n - first - length)))
    return torch.stack(rows)


# -------------------------------------------------------------------------------------------------------
# torch path


def torch_attention(q, k, v, call: AttentionCall, window: int | None) -> torch.Tensor:
    """Same semantics as the xformers path with torch SDPA (CPU, or where xformers cannot run)."""
    q_len, kv_len = q.shape[-2], k.shape[-2]
    if q_len != kv_len:
        return _new_tokens(q, k, v, call, window)
    if window is not None:
        return _band(q, k, v, call, window)
    real = call.padding_mask
    if real is None or bool(real.all()):
        return _sdpa(q, k, v, None, call, call.causal)
    return sdpa_real_tokens_first(q, k, v, real, call)


def _sdpa(q, k, v, mask, call: AttentionCall, is_causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=call.effective_dropout, is_causal=is_causal,
        scale=call.scaling,
    )


def _band(q, k, v, call: AttentionCall, window: int) -> torch.Tensor:
    """Windowed attention in O(n·window): blocked band views, one flash call (see :mod:`zoo.ops.union`)."""
    n = q.shape[-2]
    block = min(n, max(8, min(window, BAND_BLOCK)))
    real = call.padding_mask if call.padding_mask is not None else torch.ones(1, n, dtype=torch.bool, device=q.device)
    key_real = pad_to_multiple(real, block, dim=-1, value=False)
    q, k, v = (pad_to_multiple(x, block) for x in (q, k, v))
    return union_attention([band_part(q, k, v, key_real, window, call.causal, block)], call)[:, :, :n]


def _new_tokens(q, k, v, call: AttentionCall, window: int | None) -> torch.Tensor:
    """KV-cache steps (causal; the queries are the last q_len positions): an explicit (q_len, kv_len) mask."""
    pattern = None if window is None else band(window - 1)
    allowed = allowed_mask(call, pattern, q.shape[0], 1, q.shape[-2], k.shape[-2], q.device)  # new tokens x keys
    return _sdpa(q, k, v, allowed, call, False)
