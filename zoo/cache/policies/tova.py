"""TOVA: keep the keys the current query attends to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoo.cache.policies.base import KeptKeys, Policy, recorded_query_positions
from zoo.ops import kept


@dataclass(frozen=True)
class TOVA(Policy):
    """TOVA (Oren et al. 2024): the current query's attention, averaged over the heads of the KV group.

    Parameters:
        window: the recent queries whose attention is summed (1: the current query, the paper's choice).
    """

    name = "tova"
    records_queries = True
    window: int = 1

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return kept.recent_query_attention(layer.queries, recorded_query_positions(layer), layer.query_real,
                                           layer.keys, layer.pos, layer.real, layer.scaling)
