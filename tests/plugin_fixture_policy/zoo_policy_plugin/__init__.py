"""``oldest_first``: a KV policy that keeps the oldest keys beyond the sinks (the reverse of StreamingLLM's recency).

A complete third-party KV policy: a name, what the cache records for it, a score. It records the last two queries
(which it does not need) so that tests see the cache follow the policy's flags.
"""

from dataclasses import dataclass

import torch

from zoo.cache import Policy


@dataclass(frozen=True)
class OldestFirst(Policy):
    name = "oldest_first"
    records_queries = True
    query_window = 2

    def score(self, layer) -> torch.Tensor:
        return -layer.pos.to(torch.float32)
