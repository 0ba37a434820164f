"""Expected Attention: keep the keys future queries are expected to attend to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoo.cache.policies.base import KeptKeys, Policy
from zoo.ops import kept


@dataclass(frozen=True)
class ExpectedAttention(Policy):
    """Expected Attention (Devoto et al. 2025): the attention future queries, estimated from the last ``window``
    ones, are expected to give the key, times its value norm.

    Parameters:
        window: the recent queries whose mean and covariance estimate the future ones.
    """

    name = "expected_attention"
    records_queries = True
    window: int = 32

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return kept.expected_attention_scores(layer.queries, layer.query_real, layer.keys, layer.values, layer.real,
                                              layer.scaling)
