"""Give a pretrained encoder with a learned absolute position table more positions, by tiling the table.

The Longformer conversion recipe (Beltagy et al. 2020, ``convert_model_to_long.ipynb``): the new table
repeats the trained one, so position 512 gets the embedding of position 0, 513 that of 1, and so on. The
model reads long documents from the first step of fine-tuning, and every position it saw in pretraining
keeps its embedding, so outputs on short inputs are unchanged.

RoBERTa-style tables (XLM-R, CamemBERT, ...) reserve their first ``padding_idx + 1`` rows (positions
count from ``padding_idx + 1``): those rows are kept and only the rest is tiled.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

TABLE_NAMES = ("position_embeddings", "wpe")  # BERT / RoBERTa / DistilBERT / Electra ..., GPT-2


class PositionLimitError(ValueError):
    """The requested length exceeds the model's positions."""


def find_position_table(model: nn.Module) -> tuple[nn.Module, str, nn.Embedding] | None:
    """``(owner, attribute, embedding)`` of the learned absolute position table, or None (RoPE, ALiBi...)."""
    for module in model.modules():
        for name in TABLE_NAMES:
            table = getattr(module, name, None)
            if isinstance(table, nn.Embedding):
                return module, name, table
    return None


def position_offset(table: nn.Embedding) -> int:
    """Rows before position 0: RoBERTa counts positions from ``padding_idx + 1``; BERT from 0."""
    return table.padding_idx + 1 if table.padding_idx is not None else 0


def position_capacity(model: PreTrainedModel) -> int:
    """How many tokens the model can position: rows of its table (minus the offset), else the config's limit."""
    found = find_position_table(model)
    if found is None:
        return int(getattr(model.config, "max_position_embeddings", 0) or 0) or 10**9
    return found[2].num_embeddings - position_offset(found[2])


def tiled_table(weight: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    """``rows`` rows: the first ``offset`` reserved rows as they are, then the trained rows repeated."""
    trained = weight[offset:]
    repeats = -(-(rows - offset) // trained.shape[0])
    return torch.cat([weight[:offset], trained.repeat(repeats, 1)[: rows - offset]])


def longify(model: PreTrainedModel, max_positions: int) -> PreTrainedModel:
    """Extend ``model``'s learned position table (in place) so it reads ``max_positions`` tokens.

    Updates ``config.max_position_embeddings`` so ``save_pretrained`` / ``from_pretrained`` round-trip.
    A model that already has enough positions is returned unchanged.
    """
    found = find_position_table(model)
    if found is None:
        raise PositionLimitError(
            f"{type(model).__name__} has no learned absolute position table (it uses rotary or relative positions), "
            "so there is nothing to tile. Raise config.max_position_embeddings instead, if the model extrapolates."
        )
    owner, name, table = found
    offset = position_offset(table)
    rows = max_positions + offset
    if rows <= table.num_embeddings:
        return model
    with torch.no_grad():
        weight = tiled_table(table.weight, offset, rows)
    longer = nn.Embedding(
        rows, table.embedding_dim, padding_idx=table.padding_idx, device=weight.device, dtype=weight.dtype
    )
    longer.weight.data.copy_(weight)
    setattr(owner, name, longer)
    extend_position_buffers(owner, rows)
    model.config.max_position_embeddings = rows
    return model


def extend_position_buffers(owner: nn.Module, rows: int) -> None:
    """BERT-style embeddings keep ``position_ids`` (0..n-1) and all-zero ``token_type_ids`` buffers of table size."""
    position_ids = getattr(owner, "position_ids", None)
    if isinstance(position_ids, torch.Tensor):
        owner.position_ids = torch.arange(rows, device=position_ids.device, dtype=position_ids.dtype).expand(1, -1)
    token_type_ids = getattr(owner, "token_type_ids", None)
    if isinstance(token_type_ids, torch.Tensor):
        owner.token_type_ids = torch.zeros((1, rows), device=token_type_ids.device, dtype=token_type_ids.dtype)


def check_max_length(model: PreTrainedModel, max_length: int) -> None:
    """Clear error before training when ``max_length`` needs positions the model lacks."""
    capacity = position_capacity(model)
    if max_length > capacity:
        raise PositionLimitError(
            f"max_length={max_length} exceeds the {capacity} positions of {type(model).__name__} "
            f"({model.config.name_or_path or model.config.model_type}). Set `longify: true` to tile its position "
            f"table to {max_length} (zoo.convert.longify), or lower max_length to {capacity}."
        )
