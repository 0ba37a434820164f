"""Where a layer's per-token gates are projected from (:func:`gate_source`): ``nsa``'s branch gates, ``dsa``'s
indexer, the β and α of ``deltanet``, ``gated_deltanet`` and ``gla``."""

from __future__ import annotations

import torch


def gate_source(hidden_states: torch.Tensor | None, k: torch.Tensor, width: int, variant: str) -> torch.Tensor:
    """What a token's gates (β, α) are projected from: the attention module's input hidden states (B, n, hidden)
    inside a model; a kernel called alone (the contract suite) has none and uses its keys with the heads merged
    (B, n, H·d), which must then have the projection's ``width``."""
    if hidden_states is not None:
        if hidden_states.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"attention-zoo variant {variant!r}: the layer's hidden states cover {hidden_states.shape[-2]} tokens "
                f"but the keys {k.shape[-2]}; the gates need one hidden state per key."
            )
        return hidden_states
    merged = k.transpose(1, 2).flatten(2)
    if merged.shape[-1] != width:
        raise ValueError(
            f"attention-zoo variant {variant!r} projects its gates from the layer's hidden states, which the zoo hands "
            "over only inside a model; called alone, the keys (heads merged) stand in, and they have "
            f"{merged.shape[-1]} channels where the projection takes {width}."
        )
    return merged
