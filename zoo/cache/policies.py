"""KV policies: how a :class:`~zoo.cache.BudgetedLayer` chooses the keys it keeps beyond the sinks and the recent ones.

One small class per policy over :class:`Policy`, which owns the choice (protected keys first, then the top scores,
padding last; the layer gathers): a policy states its score and what the layer must record for it. The scores are
in :mod:`zoo.ops.kept`. A third party adds a policy through the entry point group ``attention_zoo.kv_policies``
(name = a :class:`Policy` subclass whose ``name`` is that name; :func:`zoo.registry.get_policy_class` finds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from zoo.ops import kept


class KeptKeys(Protocol):
    """What a policy reads of the layer it scores for (a :class:`~zoo.cache.BudgetedLayer`), per batch row and KV
    head: ``keys`` / ``values`` (B, Hk, K, d), ``pos`` (B, Hk, K) their positions, ``real`` (B, Hk, K) not padding,
    ``mass`` (B, Hk, K) the attention mass summed so far (policies that accumulate), ``queries`` (B, H, W, d) and
    ``query_real`` (B, W) the last recorded queries (policies that record them), ``scaling`` the softmax scale,
    ``seen`` the tokens seen, ``tokens`` the keys kept."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    real: torch.Tensor
    mass: torch.Tensor
    queries: torch.Tensor | None
    query_real: torch.Tensor | None
    scaling: float
    seen: int
    tokens: int
    device: torch.device

    def protected(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class Policy:
    """A KV policy. Subclasses set ``name`` and override :meth:`score`; flags say what the cache records for it:
    ``records_queries`` (the layer keeps the last ``window`` queries, ``layer.queries``), ``accumulates`` (the
    kernel adds every query's attention to ``layer.mass`` at every call), ``query_window`` (a fixed count of recorded
    queries, None: the ``window`` parameter)."""

    name: ClassVar[str] = ""
    records_queries: ClassVar[bool] = False
    accumulates: ClassVar[bool] = False
    query_window: ClassVar[int | None] = None

    def window(self, requested: int) -> int:
        """The count of recent queries recorded, given the cache's ``window`` parameter."""
        return self.query_window if self.query_window is not None else int(requested)

    def score(self, layer: KeptKeys) -> torch.Tensor:
        """(B, Hk, K) float32, higher = keep: the score of every held key."""
        raise NotImplementedError

    def keep(self, layer: KeptKeys) -> torch.Tensor:
        """(B, Hk, min(tokens, K)) indices of the held keys to keep, ascending: the protected ones (sinks, recent),
        then the highest scores; padding keys last."""
        priority = self.score(layer).masked_fill(layer.protected(), float("inf")).masked_fill(~layer.real,
                                                                                             float("-inf"))
        return priority.topk(min(layer.tokens, priority.shape[-1]), dim=-1, sorted=False).indices.sort(dim=-1).values


def recorded_query_positions(layer: KeptKeys) -> torch.Tensor:
    """(W,) positions of the recorded queries (the last W tokens seen)."""
    window = layer.queries.shape[-2]
    return torch.arange(layer.seen - window, layer.seen, device=layer.device)


@dataclass(frozen=True)
class SinksRecent(Policy):
    """StreamingLLM (Xiao et al. 2023): nothing but the sinks and the most recent keys."""

    name = "sinks_recent"

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return kept.recency_scores(layer.pos)


@dataclass(frozen=True)
class KNorm(Policy):
    """KNorm (Devoto et al. 2024): keys of low L2 norm draw the most attention."""

    name = "knorm"

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return kept.knorm_scores(layer.keys)


@dataclass(frozen=True)
class TOVA(Policy):
    """TOVA (Oren et al. 2024): the current query's attention."""

    name = "tova"
    records_queries = True
    query_window = 1

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return kept.tova_scores(layer.queries, recorded_query_positions(layer), layer.query_real, layer.keys,
                                layer.pos, layer.real, layer.scaling)


@dataclass(frozen=True)
class H2O(Policy):
    """H2O (Zhang et al. 2023): the attention mass every query gave the key so far."""

    name = "h2o"
    accumulates = True

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return layer.mass


@dataclass(frozen=True)
class SnapKV(Policy):
    """SnapKV (Li et al. 2024): the last ``window`` queries' attention, pooled over neighbouring keys."""

    name = "snapkv"
    records_queries = True

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return kept.snapkv_scores(layer.queries, recorded_query_positions(layer), layer.query_real, layer.keys,
                                  layer.pos, layer.real, layer.scaling)


@dataclass(frozen=True)
class ExpectedAttention(Policy):
    """Expected Attention (Devoto et al. 2025): the attention future queries, estimated from the last ``window``
    ones, are expected to give the key, times its value norm."""

    name = "expected_attention"
    records_queries = True

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return kept.expected_attention_scores(layer.queries, layer.query_real, layer.keys, layer.values, layer.real,
                                              layer.scaling)


BUILT_IN_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (SinksRecent, KNorm, TOVA, H2O, SnapKV, ExpectedAttention)
}
POLICIES = tuple(BUILT_IN_POLICIES)  # the built-in policies' names


def as_policy(policy: str | Policy) -> Policy:
    """``policy`` itself, or the built-in policy of that name (a plugin's: :func:`zoo.registry.get_policy_class`)."""
    if isinstance(policy, Policy):
        return policy
    cls = BUILT_IN_POLICIES.get(policy)
    if cls is None:
        raise ValueError(
            f"BudgetedLayer: unknown policy {policy!r}; use one of {', '.join(POLICIES)}, or pass a Policy object "
            "(a plugin's: zoo.registry.get_policy_class(name)())."
        )
    return cls()
