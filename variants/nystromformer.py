"""``nystromformer``: Nyström approximation of softmax attention (Xiong et al. 2021) with transformers'
``NystromformerSelfAttention`` semantics, in O(n·m·d + m³) time and O(n·m) memory for m = ``num_landmarks``.

softmax(q·kᵀ)·v ≈ softmax(q·k̃ᵀ) · pinv(softmax(q̃·k̃ᵀ)) · softmax(q̃·kᵀ)·v, the landmarks q̃, k̃ being means of m
segments of consecutive real tokens (any n; n ≤ m is plain softmax attention), plus an optional learned depthwise
convolution over the values (``conv_kernel_size``). Bidirectional only. Approximate: ``error_bound`` is stated
against softmax attention (plus the convolution; :meth:`NystromformerAttention.reference`).

Differences from transformers and their reasons: docs/notes/variants.md#nystromformer
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.ops import allowed_mask, softmax_attention
from zoo.variant import AttentionCall, Param, Variant, VariantParameterError


class NystromformerAttention(Variant):
    name = "nystromformer"
    exact = False
    supports_causal = False
    supports_dropout = False  # transformers' NystromformerSelfAttention applies none either
    time_complexity = "O(n·m·d + m³)"
    memory_complexity = "O(n·m)"
    params = {
        "num_landmarks": Param(64, int, "landmarks m: means of m segments of consecutive tokens", min=1),
        "pinv_iterations": Param(6, int, "iterations of the Moore-Penrose pseudo-inverse", min=1, max=100),
        "conv_kernel_size": Param(
            None, int, "odd length of the learned depthwise convolution over values added to the output (None: off;"
            " transformers' config uses 65)", min=1, optional=True,
        ),
    }
    # Relative Frobenius error vs softmax attention on the contract suite's inputs (q/k/v ~ N(0, 1), head_dim 16,
    # scaling 1/4, n 100, right/left/no padding, 60 draws): at the defaults (64 landmarks, no convolution) mean
    # 0.40, max 0.45; 16 landmarks: mean 0.68, max 0.74. With ``test_params`` (16 landmarks and a convolution of
    # 5, whose exact term both sides share): mean 0.20, max 0.28. Large because such inputs give softmax
    # matrices of high rank, which a rank-m product cannot hold; the tests show it shrinking as m grows.
    error_bound = 0.5
    padding_amount_invariant = False
    padding_amount_reason = ("its landmarks are means of num_landmarks segments of the padded sequence: more padding "
                             "moves the segment boundaries over the real tokens")
    test_params = {"num_landmarks": 16, "conv_kernel_size": 5}  # several tokens per landmark at n = 100

    def check_config(self) -> None:
        if self.conv_kernel_size is not None and self.conv_kernel_size % 2 == 0:
            raise VariantParameterError(
                f"attention-zoo variant 'nystromformer': parameter 'conv_kernel_size' = {self.conv_kernel_size} "
                "must be odd (the convolution is centred on each token); use an odd size such as 65, or None."
            )

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> nn.Module | None:
        if self.conv_kernel_size is None:
            return None
        return ValueConvolution(num_heads, self.conv_kernel_size)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        with torch.autocast(device_type=q.device.type, enabled=False):  # the iterative inverse needs fp32
            q, k, v32 = (x.to(compute) for x in (q, k, v))
            n = q.shape[-2]
            if n <= self.num_landmarks:
                out = softmax_attention(q, k, v32, key_padding(call.padding_mask), call.scaling)
            else:
                out = nystrom_attention(q, k, v32, call, self.num_landmarks, self.pinv_iterations)
            if self.conv_kernel_size is not None:
                out = out + self.layer_weights(call)(v32, call.padding_mask)
        return out.to(v.dtype)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """What it approximates: softmax attention over the real keys, plus the convolution when on (tests)."""
        batch, heads, n, _ = q.shape
        out = softmax_attention(q, k, v, allowed_mask(call, None, batch, heads, n, n, q.device), call.scaling)
        if self.conv_kernel_size is not None:
            out = out + self.layer_weights(call)(v.float(), call.padding_mask).to(v.dtype)
        return out

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = False) -> float:
        m = min(self.num_landmarks, n)
        kernels = 2.0 * n * m * head_dim * 3  # q·k̃ᵀ, q̃·kᵀ and its product with v, then the n x m x d product
        inverse = self.pinv_iterations * 4 * 2.0 * m**3
        conv = 2.0 * n * head_dim * (self.conv_kernel_size or 0)
        return heads * (kernels + inverse + conv)


class ValueConvolution(nn.Module):
    """One layer's depthwise convolution over each head's values along the sequence, as transformers'
    ``NystromformerSelfAttention.conv`` (Conv2d over (heads, n, head_dim), kernel (size, 1), no bias)."""

    def __init__(self, num_heads: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv2d(num_heads, num_heads, (kernel_size, 1), padding=(kernel_size // 2, 0), bias=False,
                              groups=num_heads)

    def forward(self, v: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """(B, H, n, D) values -> (B, H, n, D); padded tokens enter as zeros."""
        if padding_mask is not None:
            v = v.masked_fill(~padding_mask[:, None, :, None], 0.0)
        return F.conv2d(v, self.conv.weight.to(v.dtype), padding=self.conv.padding, groups=self.conv.groups)


def key_padding(padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, n) padding mask -> (B, 1, 1, n), broadcastable against attention scores."""
    return None if padding_mask is None else padding_mask[:, None, None, :]


def nystrom_attention(q, k, v, call: AttentionCall, num_landmarks: int, iterations: int) -> torch.Tensor:
    """The Nyström product for n > m; q/k/v (B, H, n, D) in the compute dtype.

    The scaling (√scaling on q and on k in transformers) is applied to the small landmark tensors only, which is
    the same product: s·q·k̃ᵀ = q·(s·k̃)ᵀ.
    """
    batch, heads, n, _ = q.shape
    real = call.padding_mask
    if real is None:
        real = torch.ones(batch, n, dtype=torch.bool, device=q.device)
    averaging, has_landmark = segment_averaging(real, num_landmarks, q.dtype)
    q_landmarks, k_landmarks = torch.matmul(averaging, q), torch.matmul(averaging, k)  # (B, H, m, D)
    no_landmark = ~has_landmark[:, None, None, :]  # (B, 1, 1, m)
    # Masked scores get the lowest finite value, not −inf: a row with nothing allowed (a batch row of padding only)
    # then stays finite (uniform, and zeroed as padding), and the fused softmax needs no NaN guard.
    lowest = torch.finfo(q.dtype).min
    kernel_1 = torch.softmax(torch.matmul(q, (call.scaling * k_landmarks).transpose(-1, -2)).masked_fill(
        no_landmark, lowest), -1)
    scaled_q_landmarks = call.scaling * q_landmarks
    scores_2 = torch.matmul(scaled_q_landmarks, k_landmarks.transpose(-1, -2)).masked_fill(no_landmark, lowest)
    identity = torch.eye(num_landmarks, dtype=q.dtype, device=q.device)
    # A segment without a landmark gets an identity row: the inverse then acts on the real landmarks alone.
    kernel_2 = torch.where(no_landmark.transpose(-1, -2), identity, torch.softmax(scores_2, -1))
    scores_3 = torch.matmul(scaled_q_landmarks, k.transpose(-1, -2)).masked_fill(~real[:, None, None, :], lowest)
    landmark_values = torch.matmul(torch.softmax(scores_3, -1), v)  # (B, H, m, D)
    return torch.matmul(kernel_1, torch.matmul(iterative_pinv(kernel_2, iterations), landmark_values))


def segment_averaging(real: torch.Tensor, num_landmarks: int, dtype: torch.dtype):
    """(B, 1, m, n) matrix of segment means over real tokens, and (B, m) whether a segment has any.

    Segment j holds tokens [⌊j·n/m⌋, ⌊(j+1)·n/m⌋): m segments of ⌊n/m⌋ or ⌈n/m⌉ tokens, transformers' equal
    segments when m divides n. Landmarks are ``averaging @ q`` (O(n·m), shared by every head).
    """
    n = real.shape[-1]
    segment = torch.arange(n, device=real.device) * num_landmarks // n  # (n,) segment of each token
    member = segment[None, :] == torch.arange(num_landmarks, device=real.device)[:, None]  # (m, n)
    weights = (member[None] & real[:, None, :]).to(dtype)  # (B, m, n)
    counts = weights.sum(-1, keepdim=True)
    return (weights / counts.clamp_min(1.0))[:, None], counts[..., 0] > 0


def iterative_pinv(kernel: torch.Tensor, iterations: int) -> torch.Tensor:
    """Moore-Penrose pseudo-inverse of (B, H, m, m) softmax kernels by transformers' iteration and "original" init."""
    identity = torch.eye(kernel.shape[-1], dtype=kernel.dtype, device=kernel.device)
    z = kernel.transpose(-1, -2) / kernel.sum(dim=-2).max()
    for _ in range(iterations):
        kz = torch.matmul(kernel, z)
        inner = 15 * identity - torch.matmul(kz, 7 * identity - kz)
        z = torch.matmul(0.25 * z, 13 * identity - torch.matmul(kz, inner))
    return z
