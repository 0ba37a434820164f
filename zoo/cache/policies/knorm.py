"""KNorm: keep the keys of low L2 norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoo.cache.policies.base import KeptKeys, Policy
from zoo.ops import kept


@dataclass(frozen=True)
class KNorm(Policy):
    """KNorm (Devoto et al. 2024): keys of low L2 norm draw the most attention (score = -||k||).

    Parameters: none.
    """

    name = "knorm"

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return kept.knorm_scores(layer.keys)
