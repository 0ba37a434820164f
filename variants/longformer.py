"""``longformer``: sliding-window attention with global tokens (Beltagy et al. 2020).

Query ``i`` sees key ``j`` when ``|i - j| <= (window // 2) * dilation`` and ``(i - j) % dilation == 0`` (``window``
as transformers' ``LongformerConfig.attention_window``), or when ``i`` or ``j`` is global: a position in
``global_tokens`` (default ``[0]`` bidirectional, ``[]`` causal) or a nonzero entry of a ``global_attention_mask``
(batch, seq) keyword. Padding is never global nor attended; a key counts once in each softmax. Causal: the band's
left half, and causality wins over globality. ``global_projections=True``: global query rows use their own learned
q/k/v, starting as copies of the layer's (a RoBERTa checkpoint converts unchanged); whole sequence only, no cache.
Kernel: band and global keys in one softmax (:func:`zoo.ops.union_attention`), O(n·(window + globals)); decoding
keeps the sinks and the last ``window // 2 * dilation`` keys (:class:`zoo.cache.WindowedLayer`).

Measurements and history: docs/notes/variants.md#longformer
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo.cache import WindowedLayer
from zoo.ops import KeyPart, band_part, rows_attention, selected_attention, split_blocks, union_attention
from zoo.pattern import Pattern, TokenSet, band, global_columns, global_rows, union
from zoo.variant import AttentionCall, LayerWeights, Param, Variant

MAX_BLOCK = 128  # queries per block at the default window; tuned on CPU (64..256 run close)
MIN_BLOCK = 16


class LongformerAttention(Variant):
    name = "longformer"
    exact = True
    supports_causal = True
    supports_bidirectional = True
    supports_dropout = True
    time_complexity = "O(n·w)"
    memory_complexity = "O(n·d) on CPU, else O(n·w)"
    params = {
        "window": Param(
            512, int, "attended span: window // 2 tokens on each side (causal: to the left)", min=2, per_layer=True
        ),
        "dilation": Param(1, int, "gap between attended tokens in the window", min=1),
        "global_tokens": Param(
            None,
            list,
            "positions with global attention; None = [0] bidirectional, [] causal",
            optional=True,
            list_of=int,
            min=0,
        ),
        "global_projections": Param(
            False, bool, "separate learned query/key/value projections for global attention rows (the paper's)"
        ),
    }
    test_params = {"window": 16, "global_tokens": [0, 37]}

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> nn.Module | None:
        if not self.global_projections:
            return None
        return GlobalProjections(config.hidden_size, num_heads, head_dim)

    # ----------------------------------------------------------------------------------------------
    # the spec

    def pattern(self, call: AttentionCall, q_len: int, kv_len: int) -> Pattern:
        """The (dilated) band, plus global rows and columns; reach = what windowed decoding keeps, sinks = the
        global tokens. The one definition of the pattern: kernel geometry, decoding and cache read it. A plain window
        unless dilated or the rows mark different global tokens (the cache keeps the union of the rows' sinks)."""
        reach = self._half(call.layer_idx) * self.dilation
        tokens = self.global_tokens_of(call)
        extra = [global_rows(tokens), global_columns(tokens)] if tokens else []
        return Pattern(union([band(reach, self.dilation), *extra]), reach=reach, sinks=tokens, global_queries=tokens,
                       plain_window=self.dilation == 1 and (tokens.marked is None or tokens.marked.shape[0] == 1))

    def global_tokens_of(self, call: AttentionCall) -> TokenSet:
        """The global tokens: ``global_tokens`` counted from each row's first real token (so left and right padding
        agree) and the nonzero entries of a per-batch ``global_attention_mask`` (positions of the input)."""
        fixed = self.global_tokens if self.global_tokens is not None else ([] if call.causal else [0])
        marked = call.extra.get("global_attention_mask")
        if marked is not None:
            marked = _checked_global_attention_mask(marked)
        return TokenSet(tuple(fixed), marked, call.row_start)

    def global_mask(self, call: AttentionCall, n: int, device=None) -> torch.Tensor | None:
        """(batch or 1, n) bool of global tokens (real tokens only) among positions 0 .. n-1, or None if none."""
        tokens = self.global_tokens_of(call)
        if not tokens:
            return None
        if tokens.marked is not None and tokens.marked.shape[-1] > n:
            _checked_global_attention_mask(tokens.marked, n)  # the error names the shapes
        rows = max([1, *(x.shape[0] for x in (tokens.marked, tokens.row_start) if x is not None)])
        mask = tokens(torch.arange(rows, device=device)[:, None], torch.arange(n, device=device)[None, :])
        if call.padding_mask is not None:
            mask = mask & call.padding_mask.to(mask.device)
        if torch.compiler.is_compiling():  # testing it would read the tensor on the host: keep it (maybe all False)
            return mask
        return mask if bool(mask.any()) else None

    def global_width(self, call: AttentionCall) -> int | None:
        """Inside a compiled graph, the most global tokens a row can have when it is known without reading a tensor
        (``global_tokens`` only: their number); None elsewhere (the kernel counts them)."""
        tokens = self.global_tokens_of(call)
        return len(tokens.offsets) if torch.compiler.is_compiling() and tokens.marked is None else None

    def _half(self, layer_idx: int) -> int:
        return self.per_layer("window", layer_idx) // 2

    # ----------------------------------------------------------------------------------------------
    # the kernel

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if call.decoding and isinstance(call.cache, WindowedLayer):
            return self.attend_cached(q, k, v, call)
        q_len, n = q.shape[-2], k.shape[-2]
        dilation = self.dilation
        half = self.pattern(call, q_len, n).reach // dilation  # the band's geometry comes from the pattern
        key_real = call.padding_mask if call.padding_mask is not None else q.new_ones(1, n, dtype=torch.bool)
        is_global = self.global_mask(call, n, q.device)
        first = n - q_len  # position of the first query: 0 unless decoding with a KV cache
        start = max(0, first - half * dilation)  # keys before it are in no query's window
        band_q = q if first == start else F.pad(q, (0, 0, first - start, 0))
        in_reach = (band_q, _rows_from(k, start, -2), _rows_from(v, start, -2))
        if is_global is None:
            return _last_rows(_local_attention(*in_reach, _rows_from(key_real, start), call, half, dilation), q_len)
        width = self.global_width(call)
        extra = _global_keys(k, v, is_global, call.causal, start, width)
        band_ok = _rows_from(key_real & ~is_global, start)  # global keys count once: in the appended part
        local = _last_rows(_local_attention(*in_reach, band_ok, call, half, dilation, extra), q_len)
        if not self.global_projections:
            return _with_global_rows(local, q, k, v, key_real, is_global, call, width=width)
        if q_len != n:
            raise ValueError(
                "attention-zoo variant 'longformer': global_projections=True projects the hidden states of the whole "
                f"sequence, but this call has {q_len} queries over {n} keys (decoding with a KV cache). Run the full "
                "sequence, or use global_projections=False."
            )
        return _with_global_rows(local, q, k, v, key_real, is_global, call, self.layer_weights(call), width)

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Decoding with the windowed cache: each new query over the sinks and its window among the kept keys,
        O(window + globals) per token (a global query, possible only while every key is kept, sees them all)."""
        layer = call.cache
        pattern = layer.decoding_pattern(self, call.layer_idx, call.extra, call.row_start, call)  # lengths unused
        first = layer.seen - q.shape[-2]  # the queries are the tokens this call appended, from position ``first``
        query_global = None  # no global query after the last global position
        if first < layer.complete_until and pattern.global_queries:
            query_positions = call.query_positions(q.shape[-2], k.shape[-2])
            query_global = pattern.global_queries(torch.arange(q.shape[0])[:, None], query_positions[None])
            if self.global_projections and bool(query_global.any()):
                raise ValueError(
                    "attention-zoo variant 'longformer': global_projections=True computes global query rows from "
                    "the hidden states of the whole sequence, which decoding with a cache does not have. Generate "
                    "without global query tokens, or use global_projections=False."
                )

        def select(rows: slice) -> slice | torch.Tensor | None:
            if query_global is not None and bool(query_global[:, rows].any()):
                return None
            return layer.select(first + rows.start, first + rows.stop - 1)

        return selected_attention(q, k, v, call, select, pattern)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        """Forward QK^T + PV FLOPs the blocked kernel really computes (masked band edges included)."""
        windows = self.window if isinstance(self.window, list) else [self.window]
        half = sum(windows) // len(windows) // 2
        globals_ = len(self.global_tokens) if self.global_tokens is not None else (0 if causal else 1)
        lane = math.ceil(n / self.dilation)
        block, blocks, before, after = _geometry(half, lane, causal)
        keys_per_query = before + block + after + globals_
        scored = self.dilation * blocks * block * keys_per_query + globals_ * n
        return 4.0 * scored * heads * head_dim


# --------------------------------------------------------------------------------------------------
# kernel pieces


def _checked_global_attention_mask(mask: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """(batch, L) bool over the first L <= n tokens: ``generate`` passes the prompt's mask at every step, and the
    tokens after it are not global."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 3:  # multiple choice: (batch, choices, seq), as flattened ids
        mask = mask.flatten(0, 1)
    too_long = n is not None and isinstance(mask, torch.Tensor) and mask.shape[-1] > n
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or too_long or mask.shape[-1] == 0:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"attention-zoo variant 'longformer': global_attention_mask must be a (batch, seq_len) tensor with "
            f"seq_len = {n} (nonzero = global; a shorter one covers the first tokens), got {shape}. Pass it with "
            f"the same shape as attention_mask."
        )
    return mask != 0


def _geometry(half: int, length: int, causal: bool) -> tuple[int, int, int, int]:
    """Block size, number of blocks, and band keys before/after each block for a sequence of ``length``."""
    block = min(MAX_BLOCK, max(MIN_BLOCK, _round_up(math.ceil(half / 2), MIN_BLOCK)), length)
    blocks = math.ceil(length / block)
    before = min(_round_up(half, block), (blocks - 1) * block)
    return block, blocks, before, 0 if causal else before


def _rows_from(x: torch.Tensor, start: int, dim: int = -1) -> torch.Tensor:
    """``x`` from index ``start`` on along ``dim``; no slice op (whose backward zero-fills a copy) when start is 0."""
    return x if start == 0 else x.narrow(dim, start, x.shape[dim] - start)


def _last_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    return x if x.shape[-2] == count else x[..., -count:, :]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _global_slots(is_global: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of each row's global tokens, ascending, (B, G), and which slots are real, (B, G).

    A row with fewer globals fills its spare slots with its first non-global positions (distinct ones). ``width``:
    a known upper bound of the count per row (G; no host read of the counts), else the largest count.
    """
    counts = is_global.sum(-1)
    width = int(counts.max()) if width is None else min(width, is_global.shape[-1])
    order = torch.sort(is_global.to(torch.uint8), dim=-1, descending=True, stable=True).indices
    slots = order[:, :width]
    valid = torch.arange(width, device=is_global.device)[None, :] < counts[:, None]
    return slots, valid


def _gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (B, H, N, D), rows (B|1, R) -> (B, H, R, D)."""
    b, h, _, d = x.shape
    index = rows[:, None, :, None].expand(b, h, rows.shape[-1], d)
    return x.gather(2, index)


def _local_attention(q, k, v, band_ok, call, half, dilation, extra=None) -> torch.Tensor:
    """Every query over its window (keys allowed by ``band_ok`` (B|1, n)) plus ``extra`` appended keys.

    q/k/v (B, H, n, D); ``extra`` = (keys (B, H, G, D), values, allowed (B, 1|n, G)). Pads to a block
    multiple (dilation: splits into lanes first) and returns (B, H, n, D).
    """
    batch, heads, n, head_dim = q.shape
    lane = math.ceil(n / dilation)
    block, blocks, _, _ = _geometry(half, lane, call.causal)
    padded = blocks * block * dilation
    if padded > n:
        q, k, v = (F.pad(x, (0, 0, 0, padded - n)) for x in (q, k, v))
    band_ok = F.pad(band_ok.expand(batch, n), (0, padded - n))
    if extra is not None:
        extra_k, extra_v, extra_ok = extra
        extra_ok = F.pad(extra_ok.expand(batch, n, -1), (0, 0, 0, padded - n))
    if dilation > 1:
        q, k, v = (_to_lanes(x, 2, dilation) for x in (q, k, v))
        band_ok = _to_lanes(band_ok, 1, dilation)
        if extra is not None:
            extra_ok = _to_lanes(extra_ok, 1, dilation)
            extra_k, extra_v = (x.repeat_interleave(dilation, dim=0) for x in (extra_k, extra_v))
    out = _banded(q, k, v, band_ok, half, block, call, None if extra is None else (extra_k, extra_v, extra_ok))
    if dilation > 1:
        out = _from_lanes(out, 2, dilation)
    return out if padded == n else out[..., :n, :]


def _to_lanes(x: torch.Tensor, dim: int, dilation: int) -> torch.Tensor:
    """Position m * dilation + r goes to lane r at index m; lanes join the batch: (B, .., n, ..) -> (B*d, .., n/d)."""
    return x.unflatten(dim, (-1, dilation)).movedim(dim + 1, 1).flatten(0, 1)


def _from_lanes(x: torch.Tensor, dim: int, dilation: int) -> torch.Tensor:
    return x.unflatten(0, (-1, dilation)).movedim(1, dim + 1).flatten(dim, dim + 1)


def _banded(q, k, v, band_ok, half, block, call, extra) -> torch.Tensor:
    """The window (:func:`zoo.ops.band_part`: gathered key blocks, computed chunk by chunk) and the global keys
    (``extra``, one part shared by every query block) merged into one softmax by :func:`zoo.ops.union_attention`.
    q/k/v (B, H, n, D) with n a block multiple."""
    batch, heads, n, head_dim = q.shape
    parts = [band_part(q, k, v, band_ok, half + 1, call.causal, block)]  # |i − j| ≤ half (causal: 0 ≤ i − j ≤ half)
    if extra is not None:
        extra_k, extra_v, extra_ok = extra
        groups, count = n // block, extra_k.shape[-2]
        shared = (x[:, :, None].expand(batch, heads, groups, count, x.shape[-1]) for x in (extra_k, extra_v))
        parts.append(KeyPart(split_blocks(q, block), *shared, extra_ok.reshape(batch, 1, groups, block, count)))
    return union_attention(parts, call)


def _global_keys(k, v, is_global, causal, start, width=None):
    """The global keys appended to every block: (keys (B, H, G, D), values, allowed (B, 1 | n - start, G))."""
    slots, valid = _global_slots(is_global, width)
    allowed = valid[:, None, :]  # every query sees every global key ...
    if causal:  # ... that is not in its future
        queries = torch.arange(start, is_global.shape[-1], device=slots.device)
        allowed = allowed & (slots[:, None, :] <= queries[None, :, None])
    return _gather_rows(k, slots), _gather_rows(v, slots), allowed


def _with_global_rows(local, q, k, v, key_real, is_global, call, projections=None, width=None) -> torch.Tensor:
    """``local`` (B, H, q_len, D) with the rows of global queries replaced by their attention over all keys
    (with the layer's q/k/v, or with the separate global ones of ``projections``)."""
    first = k.shape[-2] - q.shape[-2]
    rows_at, valid = _global_slots(is_global[:, first:], width)
    if rows_at.shape[-1] == 0:
        return local
    allowed = key_real[:, None, None, :] & valid[:, None, :, None]
    if call.causal:
        allowed = allowed & (torch.arange(k.shape[-2], device=k.device) <= (rows_at + first)[:, None, :, None])
    if projections is None:
        rows = rows_attention(_gather_rows(q, rows_at), k, v, allowed, call)
    else:
        rows = rows_attention(*projections.project(rows_at, q.dtype), allowed, call)
    index = rows_at[:, None, :, None].expand(rows.shape)
    # Unused slots point at distinct non-global rows (see _global_slots): they write back the local value.
    rows = torch.where(valid[:, None, :, None], rows, local.gather(2, index))
    return local.scatter(2, index, rows)


class GlobalProjections(LayerWeights):
    """One layer's ``query_global`` / ``key_global`` / ``value_global`` (hidden -> heads x head_dim, with bias),
    named as in transformers' ``LongformerSelfAttention``; applied to the attention module's input."""

    needs_hidden_states = True
    LOCAL_NAMES = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"))

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.query_global = nn.Linear(hidden_size, num_heads * head_dim)
        self.key_global = nn.Linear(hidden_size, num_heads * head_dim)
        self.value_global = nn.Linear(hidden_size, num_heads * head_dim)

    def initialize_from(self, attention: nn.Module) -> None:
        """Start as copies of the layer's query/key/value projections (BERT/RoBERTa names, or Llama's q/k/v_proj
        with grouped key/value heads repeated); other layouts keep the seeded random initialisation."""
        for names in self.LOCAL_NAMES:
            local = [getattr(attention, name, None) for name in names]
            if all(isinstance(m, nn.Linear) for m in local):
                break
        else:
            return
        for target, source in zip((self.query_global, self.key_global, self.value_global), local, strict=True):
            repeat = target.out_features // source.out_features
            weight = source.weight.unflatten(0, (-1, self.head_dim)).repeat_interleave(repeat, 0).flatten(0, 1)
            target.weight.copy_(weight)
            if source.bias is not None:
                target.bias.copy_(source.bias.unflatten(0, (-1, self.head_dim)).repeat_interleave(repeat, 0).flatten())
            else:
                target.bias.zero_()

    def project(self, rows_at: torch.Tensor, dtype: torch.dtype):
        """(query rows (B, H, R, D) of the global positions ``rows_at`` (B, R), keys and values (B, H, n, D))."""
        hidden = self.hidden_states
        if hidden is None:
            raise ValueError(
                "attention-zoo variant 'longformer': global_projections=True needs the attention module's hidden "
                "states, which the zoo hands over only when the module is called inside its model."
            )
        index = rows_at[:, :, None].expand(-1, -1, hidden.shape[-1])
        rows = self.query_global(hidden.gather(1, index))
        return tuple(self._heads(x).to(dtype) for x in (rows, self.key_global(hidden), self.value_global(hidden)))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
