"""What ``zoo bench`` measures: one self-attention layer (q/k/v projections + attention) built around a zoo variant
(here) or around a peer implementation (:mod:`zoo.bench.peers`).

Every contestant shares the same :class:`QKVProjections` (the peers' own q/k/v ``nn.Linear`` are replaced by
them), takes hidden states ``(batch, n, hidden)`` and returns ``(batch, n, hidden)``. A contestant is a small
picklable description; :meth:`Contestant.build` makes the ``nn.Module`` inside the process that measures it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import transformers
from torch import nn

from zoo.plug.dispatch import run_variant
from zoo.plug.weights import WEIGHTS_NAME, build
from zoo.registry import variant_source
from zoo.variant import AttentionCall, LayerWeights, Variant

# A pattern in the Variant.pattern style: (call, q_len, kv_len) -> index predicate or None (= every key).
PatternFn = Any


class QKVProjections(nn.Module):
    """The q/k/v projections every contestant shares (``query``/``key``/``value`` like BERT and Longformer)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project ``(B, N, hidden)`` to q, k, v of shape ``(B, heads, N, head_dim)``."""
        batch, n, _ = x.shape
        return tuple(
            proj(x).view(batch, n, self.heads, self.head_dim).transpose(1, 2)
            for proj in (self.query, self.key, self.value)
        )


def merge_heads(out: torch.Tensor) -> torch.Tensor:
    """``(B, heads, N, head_dim)`` -> ``(B, N, hidden)``."""
    batch, heads, n, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, n, heads * head_dim)


class Contestant:
    """What ``zoo bench`` measures: a name, its parameters, its cost model and a way to build the layer."""

    name: str
    kind: ClassVar[str]  # "zoo" or "peer"
    matches: tuple[str, ...] = ()  # zoo variants this contestant is compared with (peers only)
    has_reference = True  # False when the exact pattern cannot be reconstructed (BigBird's internal random blocks)
    exact: bool
    supports_dropout = False  # attention dropout in training mode (``zoo bench --dropout P``)
    memory_grows_quadratically = False  # the first guess for memory extrapolation, before two lengths are measured
    time_complexity = "?"
    memory_complexity = "?"

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params

    def unsupported(self, n: int, causal: bool) -> str | None:
        """Why this contestant cannot run at length n (a note for the table), or None."""
        return None

    def flops(self, n: int, heads: int, head_dim: int, causal: bool) -> float:
        raise NotImplementedError

    def build(self, proj: QKVProjections, n: int, causal: bool, dropout: float = 0.0) -> nn.Module:
        """The layer; ``dropout`` is the attention dropout it applies in training mode (only asked of contestants
        that declare ``supports_dropout``)."""
        raise NotImplementedError

    def reference_pattern(self, layer: nn.Module) -> PatternFn | None:
        """The keys each query may see, for the error reference (exact contestants); None = full softmax."""
        return None

    def source(self) -> tuple[str, str]:
        """(distribution, version) that provides the implementation."""
        raise NotImplementedError


class ZooAttentionLayer(nn.Module):
    """Projections + a zoo variant called through the real plumbing (:func:`zoo.plug.dispatch.run_variant`).

    A variant with learned per-layer weights (:meth:`Variant.make_module`) gets them as in a model (seeded, layer 0,
    for a config of this hidden size and heads whose ``max_position_embeddings`` is the benchmark's n), under
    ``attention_zoo``, so they move with the layer's device and dtype and are timed with it (forward and backward).
    """

    def __init__(
        self, proj: QKVProjections, variant: Variant, causal: bool, dropout: float = 0.0, n: int | None = None
    ) -> None:
        super().__init__()
        self.proj, self.variant, self.causal, self.dropout = proj, variant, causal, dropout
        config = transformers.PretrainedConfig(
            hidden_size=proj.heads * proj.head_dim, num_attention_heads=proj.heads, max_position_embeddings=n
        )
        weights = build(variant, 0, config, proj.head_dim, proj.heads)
        if isinstance(weights, LayerWeights):  # e.g. from the query/key/value projections
            with torch.no_grad():
                weights.initialize_from(proj)
        self.add_module(WEIGHTS_NAME, weights)

    @property
    def weights(self) -> nn.Module | None:
        """The variant's learned weights for this layer (None for a stateless kernel)."""
        return self._modules[WEIGHTS_NAME]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj.split(x)
        dropout = self.dropout if self.training else 0.0
        weights = self.weights
        call = AttentionCall(
            causal=self.causal, scaling=q.shape[-1] ** -0.5, dropout=dropout, training=self.training, weights=weights
        )
        if not (isinstance(weights, LayerWeights) and weights.needs_hidden_states):
            return merge_heads(run_variant(self.variant, q, k, v, call))
        weights.hidden_states = x  # as zoo.plug.weights hands them over inside a model, and drops them after the call
        try:
            return merge_heads(run_variant(self.variant, q, k, v, call))
        finally:
            weights.hidden_states = None


class ZooContestant(Contestant):
    kind = "zoo"

    def __init__(self, cls: type[Variant], params: dict[str, Any]) -> None:
        self.cls, self.name = cls, cls.name
        self.exact, self.supports_dropout = cls.exact, cls.supports_dropout
        self.time_complexity, self.memory_complexity = cls.time_complexity, cls.memory_complexity
        self.memory_grows_quadratically = any(s in cls.memory_complexity for s in ("²", "^2", "**2"))
        self._variant: Variant | None = cls(**params)  # validates the parameters now, in the parent
        super().__init__(dict(self._variant.config))

    def unsupported(self, n: int, causal: bool) -> str | None:
        if causal and not self.cls.supports_causal:
            return f"{self.name} is bidirectional only"
        if not causal and not self.cls.supports_bidirectional:
            return f"{self.name} is causal only"
        return None

    def flops(self, n: int, heads: int, head_dim: int, causal: bool) -> float:
        if self._variant is None:
            self._variant = self.cls(**self.params)
        return float(self._variant.flops(n, heads, head_dim, causal))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_variant": None}  # the measuring process builds its own

    def build(self, proj: QKVProjections, n: int, causal: bool, dropout: float = 0.0) -> nn.Module:
        return ZooAttentionLayer(proj, self.cls(**self.params), causal, dropout, n)

    def reference_pattern(self, layer: nn.Module) -> PatternFn | None:
        return layer.variant.pattern if self.exact else None

    def source(self) -> tuple[str, str]:

        src = variant_source(self.name)
        return src.distribution, src.version


class FailedContestant(Contestant):
    """A contestant that could not even be set up (e.g. a plugin whose entry point fails to import)."""

    kind = "zoo"
    exact = True
    time_complexity = memory_complexity = "–"

    def __init__(self, name: str, error: str) -> None:
        super().__init__({})
        self.name, self.error = name, error

    def source(self) -> tuple[str, str]:
        return "", ""
