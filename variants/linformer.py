"""``linformer``: low-rank attention through learned projections along the sequence (Wang et al. 2020).

K' = E[:, :n]·K, V' = F[:, :n]·V with learned E, F ∈ R^{k × max_length}, then out = softmax(Q·K'ᵀ·scale)·V':
O(n·k·d) time, O(n·k) memory. Bidirectional only (every position reaches every projected key). ``k``: projected
length (default 256); ``sharing``: ``"headwise"`` (default: one E and one F per layer), ``"key_value"`` (E = F) or
``"none"`` (per head); ``max_length``: the longest input the projections cover (default the model's
``max_position_embeddings``; longer is an error). Padded keys and values are zeroed before the projection, and a
projected key no real token reaches is masked out.

Initialisation, padding details and the exactness test: docs/notes/variants.md#linformer
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo.variant import AttentionCall, Param, Variant, VariantParameterError


class LinformerAttention(Variant):
    name = "linformer"
    exact = False
    supports_causal = False  # E·K mixes future tokens into every projected key
    supports_bidirectional = True
    supports_dropout = True
    time_complexity = "O(n·k·d)"
    memory_complexity = "O(n·k)"
    params = {
        "k": Param(256, int, "projected length: keys and values are projected along the sequence to k rows", min=1),
        "sharing": Param(
            "headwise", str,
            "'headwise': one E and one F per layer for all heads; 'key_value': one matrix per layer, E = F; "
            "'none': E and F per head",
            choices=("headwise", "key_value", "none"),
        ),
        "max_length": Param(
            None, int, "longest sequence the projections cover; None = the model's max_position_embeddings",
            optional=True, min=1,
        ),
    }
    # Relative Frobenius error vs softmax attention on the contract suite's inputs (q/k/v ~ N(0, 1), head_dim 16,
    # n = 100, max_length 4096, E and F at their seeded initialisation for 20 layers, right-, left- and unpadded):
    # k = 32 (test_params): mean 1.01, max 1.06 (all three sharings); k = 256 (default): mean 1.00, max 1.01.
    # Untrained random projections do not approximate softmax attention: the output mixes random combinations of
    # the values (≈ 1 = as far from the reference as a zero output; with max_length = n, where E's columns are
    # larger, k = 32 reaches 1.74). The bound only holds the kernel to that scale; trained E, F make Linformer
    # useful. The exactness test (identity projections) holds the kernel itself to softmax attention at 1e-5.
    error_bound = 1.2
    test_params = {"k": 32}  # below the suite's n = 100, so the projection really compresses

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> nn.Module:
        max_length = self.max_length or getattr(config, "max_position_embeddings", None)
        if max_length is None:
            raise VariantParameterError(
                f"attention-zoo variant 'linformer': the model config ({type(config).__name__}) has no "
                "max_position_embeddings to size the length projections; pass max_length=<longest sequence>."
            )
        heads = num_heads if self.sharing == "none" else 1
        return LengthProjections(self.k, int(max_length), heads, separate_values=self.sharing != "key_value")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        weights = self.layer_weights(call)
        n = k.shape[-2]
        e, f = weights.cut_to(n, q.dtype)  # (1 or heads, k, n) each
        mask = call.padding_mask
        if mask is not None:
            padded = ~mask[:, None, :, None]
            k, v = k.masked_fill(padded, 0.0), v.masked_fill(padded, 0.0)
        keys = (_along_sequence(e, k) * call.scaling).contiguous()  # (B, H, k, d); scaled here: k x d, not n x k
        values = _along_sequence(f, v).contiguous()  # contiguous heads: the batched matmuls below run several x faster
        scores = torch.matmul(q, keys.transpose(-1, -2))  # (B, H, n_q, k)
        empty = _slots_without_real_tokens(e, mask)
        if bool(empty.any()):  # only with projections that ignore some positions (e.g. identity, k > n)
            scores = scores.masked_fill(empty, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        if call.dropout > 0 and call.training:
            probs = F.dropout(probs, call.dropout, training=True)
        return torch.matmul(probs, values)

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        """E·K and F·V (2·k·n·d each) plus Q·K'ᵀ and P·V' (2·n·k·d each), per head."""
        return 8.0 * n * self.k * head_dim * heads


class LengthProjections(nn.Module):
    """One layer's E (``key_projection``) and F (``value_projection``): (heads or 1, k, max_length) each; with
    ``separate_values=False`` F is E (key-value sharing)."""

    def __init__(self, k: int, max_length: int, heads: int, separate_values: bool = True) -> None:
        super().__init__()
        self.max_length = max_length
        self.key_projection = nn.Parameter(torch.empty(heads, k, max_length))
        self.value_projection = nn.Parameter(torch.empty(heads, k, max_length)) if separate_values else None
        for matrix in (self.key_projection, self.value_projection):
            for head in matrix if matrix is not None else ():
                nn.init.xavier_uniform_(head, gain=1 / math.sqrt(2))  # fairseq examples/linformer

    def cut_to(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """E[..., :n] and F[..., :n] in ``dtype``; a clear error beyond ``max_length``."""
        if n > self.max_length:
            raise ValueError(
                f"attention-zoo variant 'linformer': the sequence has {n} tokens but the length projections cover "
                f"max_length = {self.max_length}. Truncate inputs to {self.max_length} tokens, or configure a larger "
                "max_length (zoo.configure(..., 'linformer', max_length=N)) and train the new projections."
            )
        e = self.key_projection[..., :n].to(dtype)
        f = e if self.value_projection is None else self.value_projection[..., :n].to(dtype)
        return e, f


def _along_sequence(projection: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """projection (1 or H, k, n) applied along the sequence of x (B, H, n, d) -> (B, H, k, d), one matmul."""
    if projection.shape[0] == 1:
        return torch.einsum("kn,bhnd->bhkd", projection[0], x)
    return torch.einsum("hkn,bhnd->bhkd", projection, x)


def _slots_without_real_tokens(projection: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """(B or 1, 1 or H, 1, k) bool: projected keys with zero weight on every real token (nothing to attend to)."""
    weight = projection.detach().float().abs()  # (1 or H, k, n)
    if padding_mask is None:
        return (weight.sum(-1) == 0)[None, :, None, :]
    return torch.matmul(padding_mask.float()[:, None, None, :], weight.transpose(-1, -2)) == 0
