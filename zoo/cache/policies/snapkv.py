"""SnapKV: keep the keys the prompt's last queries attend to, with their neighbours."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoo.cache.policies.base import KeptKeys, Policy, recorded_query_positions
from zoo.ops import kept


@dataclass(frozen=True)
class SnapKV(Policy):
    """SnapKV (Li et al. 2024): the last ``window`` queries' attention summed over the window, averaged over the
    heads of the KV group, max-pooled over ``pool`` neighbouring keys (keeps clusters whole).

    Parameters:
        window: the recent queries that vote (the observation window).
        pool: the pooling width over neighbouring kept keys, odd (1: no pooling).
    """

    name = "snapkv"
    records_queries = True
    window: int = 32
    pool: int = 7

    def check(self) -> None:
        if self.pool < 1 or self.pool % 2 == 0:
            raise self.invalid("pool", "an odd int >= 1 (the pooled scores keep one per key)")

    def score(self, layer: KeptKeys) -> torch.Tensor:
        return kept.snapkv_scores(layer.queries, recorded_query_positions(layer), layer.query_real, layer.keys,
                                  layer.pos, layer.real, layer.scaling, self.pool)
