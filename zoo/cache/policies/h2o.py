"""H2O: keep the heavy hitters, the keys with the most attention so far."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoo.cache.policies.base import KeptKeys, Policy


@dataclass(frozen=True)
class H2O(Policy):
    """H2O (Zhang et al. 2023): the attention mass every query gave the key so far (the kernel sums it,
    :func:`zoo.ops.kept.kept_attention`).

    Parameters: none (the paper's recent window is the cache's ``recent``; its heavy-hitter share is what the
    ``tokens`` budget leaves beyond the sinks and the recent keys).
    """

    name = "h2o"
    accumulates = True

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return layer.mass
