"""``dsa``: DeepSeek Sparse Attention (DeepSeek-V3.2, 2025), causal only.

A lightning indexer scores every earlier key of a query, ``I(t, s) = Σ_j w_tj · ReLU(q^I_tj · k^I_s)`` over
``index_heads`` small heads of ``index_dim`` channels: ``q^I_t``, ``w_t`` and ``k^I_s`` are learned projections of
the layer's input hidden states (``attention_zoo.query/key/head_weights``, no bias; no rotary: the indexer sees
positions only through the hidden states). Each query reads its ``top_k`` best real keys at positions ≤ t (ties to
the later key), one softmax, the same keys for every head; ``top_k`` at least the length is causal dense attention.
The paper's 2048 keys are for 128K contexts; the default here, 256, keeps the selection (n x top_k indices) below
the contract's n²/8 at n = 4096. Bidirectional calls are refused (the indexer ranks the past).

Kernel (:mod:`zoo.ops.dsa`): indexer scores chunk by chunk of queries (O(n²·h_I·d_I) time, never n x n), a hard
top-k without gradient, then attention over the chosen keys (O(n·top_k·d), chunked, recomputing backward; on CUDA
with triton installed the zoo's Triton kernels read the chosen rows of k and v in place, forward and backward,
:mod:`zoo.ops.backends.triton_dsa`; ``ATTENTION_ZOO_TRITON=0`` turns them off).
:meth:`DSAAttention.reference` is dense softmax attention restricted to the same keys (tests only).

Training the indexer: in a training forward the layer adds ``indexer_loss_weight`` x the KL of the indexer against
the attention's head-summed, L1-normalised probabilities over the selected keys (:func:`zoo.ops.dsa.indexer.indexer_kl`;
the indexer's input detached, the target without gradient) to the backward of its output, as DeepSeek's auxiliary
losses are added: any loss that backpropagates through the layer trains the indexer by its KL and nothing else.
The last value is kept in ``attention_zoo.last_loss``, an auxiliary loss named ``indexer_kl``
(:func:`zoo.variant.auxiliary_losses`; the zoo's Trainer logs it). ``dense_warmup=True`` is the paper's first stage
of a retrofit: the attention is dense causal SDPA and the indexer learns the dense distribution over every eligible
key (:func:`zoo.ops.dsa.indexer.dense_indexer_kl`, chunked, each chunk recomputed in the backward); freeze the rest
of the model for it, then continue with ``dense_warmup=False``. A retrofit's stage 1 runs it (:meth:`transfer_stage`).

Decoding (:class:`DSALayer`): every key and every token's indexer key; a step scores all indexer keys and reads
``top_k`` keys: O(n·h_I·d_I + top_k·d) per token.
"""

from __future__ import annotations

import torch
from torch import nn
from zoo.variants.sdpa import SDPAAttention

from zoo.cache import KernelStateLayer
from zoo.modules import gate_source
from zoo.ops import allowed_mask, softmax_attention
from zoo.ops.dsa import dense_indexer_kl, dsa_flops, indexer_kl, select_tokens, token_attention
from zoo.ops.dsa.naive import selected_mask
from zoo.variant import (
    AttentionCall,
    LayerWeights,
    Param,
    TransferStage,
    Variant,
    VariantParameterError,
    auxiliary_losses,
)


class DSAIndexer(LayerWeights):
    """One layer's lightning indexer: query (hidden -> h_I·d_I), key (hidden -> d_I), head weights (hidden -> h_I)."""

    needs_hidden_states = True
    auxiliary_loss = "indexer_kl"

    def __init__(self, hidden_size: int, heads: int, dim: int) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.query = nn.Linear(hidden_size, heads * dim, bias=False)
        self.key = nn.Linear(hidden_size, dim, bias=False)
        self.head_weights = nn.Linear(hidden_size, heads, bias=False)

    def project(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q^I (B, n, h_I, d_I), w (B, n, h_I), k^I (B, n, d_I)) of ``source`` (B, n, hidden)."""
        index_q = self.query(source).unflatten(-1, (self.heads, self.dim))
        return index_q, self.head_weights(source), self.key(source)


class _AddIndexerLoss(torch.autograd.Function):
    """Returns the attention output unchanged; its backward also starts the backward of the indexer loss."""

    @staticmethod
    def forward(ctx, out, loss):
        ctx.loss_shape = loss.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_ones(ctx.loss_shape, dtype=torch.float32)


class DSAAttention(Variant):
    name = "dsa"
    exact = True  # softmax attention restricted to the keys its indexer selects (its reference)
    supports_causal = True
    supports_bidirectional = False
    supports_dropout = True
    time_complexity = "O(n²·h_I·d_I + n·k·d)"
    memory_complexity = "O(n·(k + d)); training the indexer: O(n·k·h_I)"
    params = {
        "index_heads": Param(4, int, "indexer heads (h_I)", min=1),
        "index_dim": Param(32, int, "channels of each indexer head (d_I)", min=1),
        "top_k": Param(256, int, "keys each query reads (k)", min=1),
        "indexer_loss_weight": Param(1.0, float, "weight of the indexer's KL loss in training (0 = off)", min=0.0),
        "dense_warmup": Param(False, bool, "dense causal attention; the indexer learns the dense distribution"),
    }
    test_params = {"index_heads": 2, "index_dim": 8, "top_k": 16}

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.trains_every_parameter = self.indexer_loss_weight > 0  # else the indexer gets no gradient (DDP)

    def make_module(self, layer_idx: int, config, head_dim: int, num_heads: int) -> nn.Module:
        return DSAIndexer(config.hidden_size, self.index_heads, self.index_dim)

    def transfer_stage(self) -> TransferStage:
        """A retrofit's stage 1 is the dense warm-up: the layer's output is the original's and the indexer trains by
        its KL against the dense distribution (whatever ``indexer_loss_weight``); the retrofitted layers run sparse."""
        if self.dense_warmup:
            raise VariantParameterError(
                "attention-zoo variant 'dsa': a retrofit runs stage 1 in the dense warm-up itself and saves sparse "
                "layers; drop dense_warmup from variant_params."
            )
        return TransferStage({"dense_warmup": True, "indexer_loss_weight": 1.0}, DSAIndexer.auxiliary_loss)

    def cache_layer(self, layer_idx: int, config) -> DSALayer:
        return DSALayer()

    def flops(self, n: int, heads: int, head_dim: int, causal: bool = True) -> float:
        return dsa_flops(n, heads, head_dim, self.index_heads, self.index_dim, self.top_k)

    def selection(self, q, k, call: AttentionCall):
        """(index, chosen) (B, Q, k') of the keys each query reads, and the indexer's inputs (q^I, w, k^I)."""
        index_q, index_w, index_k = self.indexer_inputs(self.layer_weights(call), q, k, call)
        n = k.shape[-2]
        positions = torch.arange(n - q.shape[-2], n, device=q.device)
        index, chosen = select_tokens(index_q, index_w, index_k, positions, call.padding_mask, self.top_k)
        return index, chosen, (index_q, index_w, index_k)

    def indexer_inputs(self, weights: DSAIndexer, q, k, call: AttentionCall):
        """(q^I (B, Q, h_I, d_I), w (B, Q, h_I), k^I (B, n, d_I)) of the call's queries and keys; with the variant's
        cache, this call's indexer keys are appended to it."""
        count, n = q.shape[-2], k.shape[-2]
        layer = call.cache if isinstance(call.cache, DSALayer) else None
        hidden = weights.hidden_states
        if layer is None and hidden is not None and hidden.shape[-2] != n:
            raise ValueError(
                f"attention-zoo variant 'dsa': the layer's hidden states cover {hidden.shape[-2]} tokens but the keys "
                f"{n}; decode with the variant's own cache (zoo's generate does), which keeps the indexer keys."
            )
        if layer is None:
            source = gate_source(hidden, k, weights.key.in_features, self.name)
        else:
            source = hidden if hidden is not None else gate_source(None, k[..., -count:, :], weights.key.in_features,
                                                                   self.name)
        index_q, index_w, index_k = weights.project(source.detach().to(weights.key.weight.dtype))
        index_q, index_w = index_q[:, -count:], index_w[:, -count:]
        if layer is not None:
            index_k = layer.add_index_keys(index_k)
        return index_q, index_w, index_k

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        weights = self.layer_weights(call)
        trains = call.training and torch.is_grad_enabled() and weights.key.weight.requires_grad
        trains = trains and self.indexer_loss_weight > 0
        if self.dense_warmup:
            out = SDPAAttention().attend(q, k, v, call)
            if not trains:
                return out
            indexer = self.indexer_inputs(weights, q, k, call)
            loss = dense_indexer_kl(q.detach(), k.detach(), *indexer, call.scaling, call.padding_mask)
        else:
            index, chosen, indexer = self.selection(q, k, call)
            out = token_attention(q, k, v, index, chosen, call, with_target=trains)
            if not trains:
                return out
            out, target = out
            real = None if call.padding_mask is None else call.padding_mask[:, -q.shape[-2]:].float()
            loss = indexer_kl(q.detach(), k.detach(), *indexer, index, chosen, call.scaling, real, target)
        weights.last_loss = loss.detach()
        return _AddIndexerLoss.apply(out, loss * self.indexer_loss_weight)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Dense softmax attention over exactly the keys the indexer selects (every key in the dense warm-up; O(n²),
        tests only)."""
        if self.dense_warmup:
            allowed = allowed_mask(call, None, q.shape[0], 1, q.shape[-2], k.shape[-2], q.device)
        else:
            index, chosen, _ = self.selection(q, k, call)
            allowed = selected_mask(index, chosen, k.shape[-2])[:, None]
        return softmax_attention(q, k, v, allowed, call.scaling)


def indexer_losses(model: nn.Module) -> torch.Tensor | None:
    """The sum of every DSA layer's last indexer loss (detached, for logging), or None before a training forward."""
    return auxiliary_losses(model).get(DSAIndexer.auxiliary_loss)


class DSALayer(KernelStateLayer):
    """Every key and every token's indexer key (``index_keys`` (B, n, d_I)), appended by the kernel into a buffer
    that grows like the keys' (:class:`zoo.cache.GrowingLayer`): a step copies its own indexer key, not all of them."""

    state_names = ("index_keys",)

    def clear_state(self) -> None:
        super().clear_state()
        self._index_buffer: torch.Tensor | None = None

    def add_index_keys(self, new: torch.Tensor) -> torch.Tensor:
        """Append the indexer keys of this call's tokens (B, new, d_I); returns all (B, seen, d_I)."""
        kept = self.index_keys if self.index_keys is not None else new[:, :0]
        length = self.seen - new.shape[1]  # after a crop, fewer than were kept
        buffer = self._index_buffer
        held = buffer is not None and kept.shape[1] and kept.data_ptr() == buffer.data_ptr()
        if not held or buffer.shape[1] < self.seen or buffer.shape[0] != new.shape[0]:
            buffer = new.new_empty(new.shape[0], self.seen + max(self.MIN_GROWTH, self.seen // 8), new.shape[-1])
            buffer[:, :length].copy_(kept[:, :length])
            self._index_buffer = buffer
        buffer[:, length : self.seen].copy_(new.detach())
        self.index_keys = buffer[:, : self.seen]
        return self.index_keys
