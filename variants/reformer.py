"""``reformer``: LSH attention (Kitaev et al. 2020) with shared query-key, in O(n·r·(c·d + log n)) time.

Keys are the queries RMS-normalized (key_j = q_j·√d/‖q_j‖; the model's key projection is unused), values the
model's. Per round (``n_hashes`` = r): hash by a random rotation drawn per (seed, layer, head, round), sort by
(bucket, position), cut into chunks of c = ``bucket_size``. Bidirectional: a chunk attends to itself and the previous
chunk. Causal: a query attends to the at most c earlier tokens of its own bucket (the paper's chunk rule would let
the future move chunk boundaries). A query sees itself only when it has no other key; rounds merge by log-sum-exp.
Approximate: ``reference`` is full shared-QK attention, ``error_bound`` is stated against it. Nothing n x n is built.

Hashing details, transformers comparison and rationale: docs/notes/variants.md#reformer
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from zoo.ops import allowed_mask, safe_softmax, stream_seed
from zoo.ops.flash import flash_available, flash_backward, flash_forward
from zoo.variant import AttentionCall, Param, Variant, VariantParameterError

MAX_ROTATION = 128  # automatic bucket counts above this are hashed as the product of two smaller hashes


class ReformerAttention(Variant):
    name = "reformer"
    exact = False
    trains_every_parameter = False  # shared-QK: the model's key projection gets no gradient
    time_complexity = "O(n·r·(c·d + log n))"
    memory_complexity = "O(n·r·c)"
    params = {
        "n_hashes": Param(2, int, "hashing rounds r, combined by log-sum-exp", min=1, max=64),
        "bucket_size": Param(
            64, int, "chunk length c: sorted chunks of c queries attend to their own and the previous chunk", min=1
        ),
        "n_buckets": Param(
            None, int, "buckets per round, even (None = 2·⌈n / bucket_size⌉, hashed as two factors above 128)",
            min=2, optional=True,
        ),
        "seed": Param(0, int, "seed of the random rotations (combined with the layer index)", min=0),
    }
    # Relative Frobenius error vs full shared-QK attention (``reference``) on the contract suite's inputs (q/k/v ~
    # N(0, 1), head_dim 16, scaling 1/4, n 100, causal and bidirectional, padded or not; 120 draws of inputs and
    # seeds): with ``test_params`` (bucket_size 32) mean 0.99, max 1.52; at the defaults (bucket_size 64) mean
    # 0.66, max 1.10. Above 1 because such inputs are the worst case for any sparse attention: their attention is
    # flat, so the reference is an average of ~100 random values with a small norm, and an average over a subset
    # of keys differs by more than that norm. Against softmax(q·k) with the model's own keys (what the benchmark
    # reports): mean 1.45 and 1.25. The tests hold the kernel exactly to its own LSH pattern and show the error
    # shrinking with n_hashes on clustered inputs.
    error_bound = 1.75
    padding_amount_invariant = False
    padding_amount_reason = ("its number of hash buckets (2·⌈n/64⌉ by default) and its chunks of sorted tokens follow "
                             "the padded length")
    test_params = {"bucket_size": 32}  # 4 sorted chunks at the contract suite's n = 100

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self._rotations: dict[tuple, torch.Tensor] = {}

    def check_config(self) -> None:
        if self.n_buckets is not None and self.n_buckets % 2:
            raise VariantParameterError(
                f"attention-zoo variant 'reformer': parameter 'n_buckets' = {self.n_buckets} must be even "
                "(a bucket is the argmax over [xR, -xR]); use an even number or None for the automatic count."
            )

    # ---------------------------------------------------------------------------------------------------
    # hashing

    def bucket_factors(self, n: int) -> list[int]:
        """Bucket counts of the hashes whose product is a round's bucket: one, or two above MAX_ROTATION buckets."""
        if self.n_buckets is not None:
            return [self.n_buckets]
        total = 2 * math.ceil(n / self.bucket_size)
        if total <= MAX_ROTATION:
            return [total]
        first = 2 * math.ceil(math.sqrt(total) / 2)
        return [first, 2 * math.ceil(total / first / 2)]

    def rotations(self, layer: int, heads: int, head_dim: int, factors: list[int], device) -> torch.Tensor:
        """(heads, n_hashes, head_dim, Σ factors / 2) Gaussian rotations for (seed, layer), drawn on CPU in fp32."""
        key = (layer, heads, head_dim, tuple(factors), str(device))
        cached = self._rotations.get(key)
        if cached is None:
            generator = torch.Generator().manual_seed(stream_seed("reformer", self.seed, layer))
            shape = (heads, self.n_hashes, head_dim, sum(factors) // 2)
            cached = self._rotations[key] = torch.randn(shape, generator=generator).to(device)
        return cached

    def hash_buckets(self, q: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """(B, H, r, n) long bucket of every token in every round; padded tokens get the extra bucket ∏ factors."""
        batch, heads, n, head_dim = q.shape
        factors = self.bucket_factors(n)
        rotations = self.rotations(call.layer_idx, heads, head_dim, factors, q.device)
        with torch.no_grad():
            projected = torch.einsum("bhnd,hrdk->bhrnk", q.detach().float(), rotations)
            buckets, start, radix = 0, 0, 1
            for factor in factors:
                part = projected[..., start : start + factor // 2]
                buckets = buckets + radix * torch.cat([part, -part], dim=-1).argmax(-1)
                start, radix = start + factor // 2, radix * factor
            if call.padding_mask is not None:
                real = call.padding_mask.to(q.device, torch.bool)[:, None, None, :]
                buckets = buckets.masked_fill(~real, radix)
        return buckets

    # ---------------------------------------------------------------------------------------------------
    # attention

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"attention-zoo variant 'reformer' attends over the queries themselves (shared query-key), so it "
                f"needs every token's query: got {q.shape[-2]} queries for {k.shape[-2]} keys (a KV cache). "
                "Run the model without a cache (use_cache=False), or pick a variant that supports one."
            )
        buckets = self.hash_buckets(q, call)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        with torch.autocast(device_type=q.device.type, enabled=False):
            out = lsh_attention(q.to(compute), v.to(compute), buckets, self.bucket_size, call)
        return out.to(v.dtype)

    def cache_layer(self, layer_idx: int, config):
        raise ValueError(
            "attention-zoo variant 'reformer' cannot decode with a KV cache: its keys are the queries of every earlier "
            "token (shared query-key), which a cache of keys does not hold. Generate with use_cache=False (each step "
            "reruns the whole sequence), or pick a variant with a cache (see `zoo list`)."
        )

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Full shared-QK attention, what LSH approximates: every allowed key but itself, itself when alone (O(n²))."""
        batch, heads, n, _ = q.shape
        allowed = allowed_mask(call, None, batch, heads, n, n, q.device)
        not_self = ~torch.eye(n, dtype=torch.bool, device=q.device)
        allowed = not_self if allowed is None else allowed & not_self
        keys = shared_keys(q.float())
        scores = torch.matmul(q.float(), keys.transpose(-1, -2)).mul(call.scaling).masked_fill(~allowed, float("-inf"))
        out = torch.matmul(safe_softmax(scores), v.float())
        return torch.where(~allowed.any(-1, keepdim=True), v.float(), out).to(v.dtype)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        hashing = 2.0 * n * head_dim * sum(self.bucket_factors(n)) / 2
        chunks = 4.0 * n * 2 * self.bucket_size * head_dim  # scores and weighted values over 2c keys per query
        return heads * self.n_hashes * (hashing + chunks)


def shared_keys(q: torch.Tensor) -> torch.Tensor:
    """The keys of shared-QK attention: the queries RMS-normalized (norm √d), transformers' ``_len_norm``."""
    return q * torch.rsqrt(q.square().mean(-1, keepdim=True) + 1e-6)


def lsh_attention(q: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor, chunk: int, call: AttentionCall):
    """Shared-QK attention within sorted chunks, rounds merged by log-sum-exp. q (B, H, n, D), v (B, H, n, Dv),
    buckets (B, H, r, n) with padded tokens in the largest bucket. Returns (B, H, n, Dv).

    On CPU without dropout the chunks run the flash kernel and the rounds merge through its log-sum-exps
    (:class:`_SortedChunksFlash`); elsewhere the (r·n, 2c) scores are materialized.
    """
    batch, heads, n, _ = q.shape
    rounds = buckets.shape[2]
    padded = math.ceil(n / chunk) * chunk
    # Tokens added to reach a multiple of the chunk length sort after everything (bucket beyond the padding one).
    if padded > n:
        buckets = F.pad(buckets, (0, padded - n), value=int(buckets.max()) + 1)
        q, v = (F.pad(x, (0, 0, 0, padded - n)) for x in (q, v))
    with torch.no_grad():
        position = torch.arange(padded, device=q.device)
        order = (buckets * padded + position).argsort(dim=-1)  # (B, H, r, N): sorted slot -> token
        unsort = torch.empty_like(order).scatter_(-1, order, position.expand_as(order))  # token -> sorted slot
        allowed = chunk_allowed(buckets.gather(-1, order), real_count(call.padding_mask, batch, n, q.device), chunk,
                                call.causal)
        empty = ~allowed.any(-1).expand(batch, heads, rounds, -1, -1).flatten(3)  # (B, H, r, N): no key this round
        alone = take(empty[..., None].to(q.dtype), unsort, rounds=True).bool().all(2)  # (B, H, N, 1): none at all
    keys = shared_keys(q)
    dropout = call.effective_dropout
    if flash_available(q) and not dropout:  # with dropout: the chunk-sized fallback below
        out = _SortedChunksFlash.apply(q, keys, v, allowed, order, unsort, call.scaling)
    else:
        q_sorted, keys, values = (chunked(take(x, order), chunk) for x in (q, keys, v))
        keys, values = with_previous_chunk(keys), with_previous_chunk(values)
        scores = torch.matmul(q_sorted, keys.transpose(-1, -2)).mul(call.scaling).masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0))  # a row without keys: zeros, not NaN
        probs = F.dropout(probs, p=dropout) if dropout else probs
        out = torch.matmul(probs, values).flatten(3, 4)
        out, _ = merge(take(out, unsort, rounds=True), take(lse.flatten(3, 4), unsort, rounds=True)[..., 0], dim=2)
    if bool(alone.any()):  # a token with no other key in any round attends to itself (the paper's exception)
        out = torch.where(alone, v, out)
    return out[:, :, :n]


def real_count(padding_mask: torch.Tensor | None, batch: int, n: int, device) -> torch.Tensor:
    """(B,) real tokens per row: padded tokens sort after every real one, so they fill the last sorted slots."""
    if padding_mask is None:
        return torch.full((batch,), n, device=device)
    return padding_mask.to(device, torch.bool).sum(-1)


def chunk_allowed(sorted_buckets: torch.Tensor, real: torch.Tensor, chunk: int, causal: bool) -> torch.Tensor:
    """Bool (B, H|1, r|1, C, c, 2c): the keys each sorted query may see in [previous chunk, own chunk], itself
    excluded.

    Bidirectional: every real key (the first chunk has no previous one). Causal: keys of the query's own bucket
    at most c sorted slots back (slot t of [previous, own] lies c + s − t slots before query s).
    """
    padded = sorted_buckets.shape[-1]
    slot = torch.arange(padded, device=real.device)
    allowed = with_previous_chunk(chunked((slot < real[:, None])[:, None, None], chunk))[..., None, :]
    keys, queries = torch.arange(2 * chunk, device=real.device), torch.arange(chunk, device=real.device)[:, None]
    allowed = allowed & (keys != queries + chunk)
    if causal:
        own = chunked(sorted_buckets, chunk)
        same_bucket = own[..., :, None] == with_previous_chunk(own)[..., None, :]
        allowed = allowed & same_bucket & (keys >= queries) & (keys <= queries + chunk)
    return allowed


def merge(out: torch.Tensor, lse: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Parts stacked along ``dim`` of out (..., Dv) and lse (...; −inf: no key) -> one softmax over their union:
    (output, log-sum-exp); a query without keys in every part gets zeros and log-sum-exp −inf."""
    total = torch.logsumexp(lse, dim=dim, keepdim=True)
    weights = torch.exp(lse - total.masked_fill(torch.isinf(total), 0.0))[..., None].to(out.dtype)
    return (out * weights).sum(dim), total.squeeze(dim)


class _SortedChunksFlash(torch.autograd.Function):
    """The chunks of every round through the CPU flash kernel, from token-order q, keys, v (B, H, N, D).

    Works on slices of one batch row and a few heads (:func:`head_slices`, cache-sized). Per slice, two flash
    calls on views of the sorted tensors (no concatenated copies): each chunk over its own chunk, and chunks 1..
    over the chunk before; the 2·r parts merge by log-sum-exp. The backward gathers the sorted tensors again
    (recompute), runs the flash backward of every part with the *merged* output and log-sum-exp, which is the
    exact gradient of the joint softmax (as :mod:`zoo.ops.union` does), and takes the gradients back to token
    order with the inverse permutation (a gather, not a scatter).
    """

    @staticmethod
    def forward(ctx, q, keys, v, allowed, order, unsort, scale):
        merged = q.new_empty(q.shape[:-1] + v.shape[-1:])
        total = q.new_empty(q.shape[:-1])
        for rows, mask in head_slices(q, order, allowed):
            merged[rows], total[rows] = _slice_forward(q[rows], keys[rows], v[rows], mask, order[rows], unsort[rows],
                                                       scale)
        ctx.scale = scale
        total.masked_fill_(torch.isinf(total), 0.0)  # a token without keys: zero gradients in the backward
        ctx.save_for_backward(q, keys, v, allowed, order, unsort, merged, total)
        return merged

    @staticmethod
    def backward(ctx, grad):
        q, keys, v, allowed, order, unsort, merged, total = ctx.saved_tensors
        grad = grad.contiguous()
        grads = [torch.empty_like(x) for x in (q, keys, v)]
        for rows, mask in head_slices(q, order, allowed):
            parts = _slice_backward(grad[rows], q[rows], keys[rows], v[rows], merged[rows], total[rows], mask,
                                    order[rows], unsort[rows], ctx.scale)
            for full, part in zip(grads, parts, strict=True):
                full[rows] = part
        return (*grads, None, None, None, None)


SLICE_ELEMENTS = 2**21  # sorted elements (rounds x N x D) per slice of heads: 8 MB in fp32


def head_slices(q: torch.Tensor, order: torch.Tensor, allowed: torch.Tensor):
    """(index, allowed of that slice): one batch row and as many heads as keep a slice's sorted tensors small."""
    batch, heads, rounds, padded = order.shape
    step = max(1, SLICE_ELEMENTS // (rounds * padded * q.shape[-1]))
    for b in range(batch):
        for h in range(0, heads, step):
            rows = (slice(b, b + 1), slice(h, min(h + step, heads)))
            mask = allowed[rows[0] if allowed.shape[0] > 1 else slice(0, 1)]
            yield rows, mask[:, rows[1]] if mask.shape[1] > 1 else mask


def _slice_parts(allowed: torch.Tensor, dtype: torch.dtype):
    """The flash kernel's additive masks (h·r|1, C, c, c) of the own-chunk and previous-chunk parts of a slice."""
    chunk = allowed.shape[-2]
    for part in (allowed[0, ..., chunk:], allowed[0, ..., 1:, :, :chunk]):
        bias = torch.zeros(part.shape, dtype=dtype, device=part.device).masked_fill_(~part, float("-inf"))
        yield bias.flatten(0, 1)


def _slice_forward(q, keys, v, allowed, order, unsort, scale):
    """One slice (1, h, N, D): the merged output (1, h, N, Dv) and log-sum-exp (1, h, N)."""
    chunk = allowed.shape[-2]
    _, heads, rounds, padded = order.shape
    chunks = padded // chunk
    own, previous = _slice_parts(allowed, q.dtype)
    q_s, k_s, v_s = (sort_rows(x, order, chunk)[0].flatten(0, 1) for x in (q, keys, v))  # (h·r, C, c, D)
    out, lse = flash_forward(q_s, k_s, v_s, own, scale)
    lse = lse.masked_fill(~allowed[0, ..., chunk:].any(-1).flatten(0, 1), float("-inf"))  # flash says 0: no key
    if chunks > 1:
        out_prev, lse_prev = flash_forward(q_s[:, 1:], k_s[:, :-1], v_s[:, :-1], previous, scale)
        lse_prev = lse_prev.masked_fill(~allowed[0, ..., 1:, :, :chunk].any(-1).flatten(0, 1), float("-inf"))
        total = torch.logaddexp(lse[:, 1:], lse_prev)
        safe = total.masked_fill(torch.isinf(total), 0.0)[..., None]
        joint = out[:, 1:] * torch.exp(lse[:, 1:, :, None] - safe) + out_prev * torch.exp(lse_prev[..., None] - safe)
        out = torch.cat([out[:, :1], joint], dim=1)
        lse = torch.cat([lse[:, :1], total], dim=1)
    out = out.reshape(1, heads, rounds, padded, -1)
    lse = lse.reshape(1, heads, rounds, padded, 1)
    return merge(unsort_rows(out, unsort), unsort_rows(lse, unsort)[..., 0], dim=2)


def _slice_backward(grad, q, keys, v, merged, total, allowed, order, unsort, scale):
    """Gradients (q, keys, v) of one slice, in token order."""
    chunk = allowed.shape[-2]
    _, heads, rounds, padded = order.shape
    own, previous = _slice_parts(allowed, q.dtype)
    g, q_s, k_s, v_s, m = (sort_rows(x, order, chunk)[0].flatten(0, 1) for x in (grad, q, keys, v, merged))
    t = sort_rows(total[..., None], order, chunk)[0].flatten(0, 1)[..., 0]
    gq, gk, gv = flash_backward(g, q_s, k_s, v_s, m, t, own, scale)
    if padded > chunk:
        gq_prev, gk_prev, gv_prev = flash_backward(g[:, 1:], q_s[:, 1:], k_s[:, :-1], v_s[:, :-1], m[:, 1:],
                                                   t[:, 1:], previous, scale)
        gq[:, 1:] += gq_prev
        gk[:, :-1] += gk_prev
        gv[:, :-1] += gv_prev
    return [unsort_rows(x.reshape(1, heads, rounds, padded, -1), unsort).sum(2) for x in (gq, gk, gv)]


def sort_rows(x: torch.Tensor, order: torch.Tensor, chunk: int) -> torch.Tensor:
    """Token-order x (B, H, N, D) into every round's sorted order, in chunks: (B, H, r, C, c, D)."""
    return take(x, order).unflatten(3, (-1, chunk))


def unsort_rows(x: torch.Tensor, unsort: torch.Tensor) -> torch.Tensor:
    """Sorted-order rounds x (B, H, r, N, D) back to token order (the inverse permutation of each round)."""
    return take(x, unsort, rounds=True)


def chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, H, r, N, *rest) -> (B, H, r, N / c, c, *rest) (a view)."""
    return x.unflatten(3, (x.shape[3] // chunk, chunk))


def with_previous_chunk(x: torch.Tensor) -> torch.Tensor:
    """(B, H, r, C, c, *rest) -> (B, H, r, C, 2c, *rest): each chunk preceded by the previous one (zeros before
    the first chunk, so nothing wraps around)."""
    previous = torch.cat([torch.zeros_like(x[:, :, :, :1]), x[:, :, :, :-1]], dim=3)
    return torch.cat([previous, x], dim=4)


def take(x: torch.Tensor, index: torch.Tensor, rounds: bool = False) -> torch.Tensor:
    """Rows of x along the sequence by ``index`` (B, H, r, N) -> (B, H, r, N, D).

    x is (B, H, N, D) (the same rows for every round) or, with ``rounds``, (B, H, r, N, D). One flat
    ``index_select``: its backward is one ``index_add``.
    """
    batch, heads, r, length = index.shape
    groups = batch * heads * (r if rounds else 1)
    base = torch.arange(groups, device=x.device) * x.shape[-2]
    base = base.view(batch, heads, r if rounds else 1, 1)
    flat = x.reshape(groups * x.shape[-2], x.shape[-1])
    return flat.index_select(0, (index + base).flatten()).view(batch, heads, r, length, x.shape[-1])
