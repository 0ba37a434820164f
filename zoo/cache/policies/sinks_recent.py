"""StreamingLLM's choice: nothing beyond the sinks and the most recent keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoo.cache.policies.base import KeptKeys, Policy
from zoo.ops import kept


@dataclass(frozen=True)
class SinksRecent(Policy):
    """StreamingLLM (Xiao et al. 2023): nothing but the sinks and the most recent keys (score = position).

    Parameters: none (the sinks and the recent count are the cache's ``sinks`` and ``recent``).
    """

    name = "sinks_recent"

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return kept.recency_scores(layer.pos)
