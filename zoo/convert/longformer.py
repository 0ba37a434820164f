"""Convert a transformers Longformer checkpoint into the equivalent RoBERTa-family model running the zoo's
``longformer`` variant, so Longformer fine-tunes run on the zoo's kernel and continue with every zoo recipe.

transformers' Longformer is a RoBERTa with its own attention: the same embeddings, layers, heads and state-dict
names (``longformer.`` instead of ``roberta.``), plus per layer the global projections ``query_global``,
``key_global`` and ``value_global``. The conversion keeps every weight, moves the global projections to
``attention.self.attention_zoo.*`` (the variant's learned weights, ``global_projections=True``), and sets the
variant's window from ``attention_window`` (one value, or a list when the layers differ).

Global attention: as in transformers, pass ``global_attention_mask`` (batch, seq) -- (batch, choices, seq) for
multiple choice -- to the converted model. Where transformers' task model picks global tokens when none are
given, the converted model does the same for sequence classification (the ``<s>`` token, recorded in the config
as ``global_tokens=[0]``); question answering and multiple choice derive theirs from the input ids (question
tokens, resp. tokens after the first separator), which the attention never sees, so build that mask with
:func:`longformer_global_attention_mask` and pass it.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from zoo.plug._patches import compute_global_attention_mask
from zoo.plug.install import configure
from zoo.plug.weights import WEIGHTS_NAME

ROBERTA_CLASS = {
    "LongformerModel": "RobertaModel",
    "LongformerForMaskedLM": "RobertaForMaskedLM",
    "LongformerForSequenceClassification": "RobertaForSequenceClassification",
    "LongformerForTokenClassification": "RobertaForTokenClassification",
    "LongformerForQuestionAnswering": "RobertaForQuestionAnswering",
    "LongformerForMultipleChoice": "RobertaForMultipleChoice",
}
# Global tokens transformers' task model uses when no global_attention_mask is given, where they do not depend
# on the input ids.
DEFAULT_GLOBAL_TOKENS = {"LongformerForSequenceClassification": [0]}
LONGFORMER_ONLY_KEYS = ("attention_window", "onnx_export", "model_type", "architectures", "transformers_version")
GLOBAL_PROJECTIONS = ("query_global", "key_global", "value_global")
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "subfolder", "force_download", "proxies")


class NotALongformerError(TypeError):
    """The model or checkpoint given to :func:`from_longformer` is not a transformers Longformer."""


def from_longformer(path_or_model: str | PreTrainedModel, **from_pretrained_kwargs: Any) -> PreTrainedModel:
    """The RoBERTa-family equivalent of a transformers Longformer (a model, or a path / Hub id of a checkpoint).

    ``LongformerModel`` becomes ``RobertaModel``, ``LongformerFor<Task>`` becomes ``RobertaFor<Task>``, with the
    zoo ``longformer`` variant (``global_projections=True``, the checkpoint's windows, ``global_tokens`` as
    described in the module docstring). Outputs equal the Longformer's on every length (transformers pads to a
    multiple of the window internally; the zoo does not need to). ``from_pretrained_kwargs`` go to the
    Longformer's ``from_pretrained`` when a path is given. Save the result with ``save_pretrained``: it loads back
    with ``AutoModel...from_pretrained`` after ``import zoo``.
    """
    source = _load_longformer(path_or_model, **from_pretrained_kwargs)
    kind = type(source).__name__
    config = roberta_config(source.config, DEFAULT_GLOBAL_TOKENS.get(kind, []))
    target_cls = getattr(transformers, ROBERTA_CLASS[kind])
    if kind == "LongformerModel":
        target = target_cls(config, add_pooling_layer=source.pooler is not None)
    else:
        target = target_cls(config)
    state = {roberta_key(key): value for key, value in source.state_dict().items()}
    target.load_state_dict(state, strict=True)
    reference = next(source.parameters())
    return target.to(device=reference.device, dtype=reference.dtype).train(source.training)


def _load_longformer(path_or_model: str | PreTrainedModel, **kwargs: Any) -> PreTrainedModel:
    if isinstance(path_or_model, PreTrainedModel):
        model = path_or_model
    else:
        where = {k: v for k, v in kwargs.items() if k in HUB_KWARGS}
        config = transformers.AutoConfig.from_pretrained(path_or_model, **where)
        if config.model_type != "longformer":
            raise NotALongformerError(
                f"zoo.from_longformer: {path_or_model!r} is a {config.model_type!r} checkpoint, not a Longformer. "
                "For a BERT/RoBERTa checkpoint, use zoo.configure(model, 'longformer', ...) (and zoo.convert.longify)."
            )
        architecture = next((a for a in config.architectures or [] if a in ROBERTA_CLASS), "LongformerModel")
        model = getattr(transformers, architecture).from_pretrained(path_or_model, **kwargs)
    if type(model).__name__ not in ROBERTA_CLASS:
        raise NotALongformerError(
            f"zoo.from_longformer converts {', '.join(ROBERTA_CLASS)}; got {type(model).__name__}."
        )
    return model


def roberta_config(longformer_config, global_tokens: list[int]) -> transformers.RobertaConfig:
    """A RoBERTa config with the Longformer's sizes, labels and token ids, configured for the zoo ``longformer``."""
    values = {k: v for k, v in longformer_config.to_dict().items() if k not in LONGFORMER_ONLY_KEYS}
    config = transformers.RobertaConfig(**values)
    windows = longformer_config.attention_window
    if isinstance(windows, (list, tuple)):
        windows = windows[0] if len(set(windows)) == 1 else list(windows)
    return configure(config, "longformer", window=windows, global_tokens=global_tokens, global_projections=True)


def roberta_key(key: str) -> str:
    """``longformer.encoder.layer.0.attention.self.query_global.weight`` ->
    ``roberta.encoder.layer.0.attention.self.attention_zoo.query_global.weight``."""
    if key.startswith("longformer."):
        key = "roberta." + key[len("longformer.") :]
    for name in GLOBAL_PROJECTIONS:
        key = key.replace(f".attention.self.{name}.", f".attention.self.{WEIGHTS_NAME}.{name}.")
    return key


def longformer_global_attention_mask(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The global attention transformers' Longformer task model would use for ``input_ids`` when given none:
    question tokens (question answering), tokens after the first separator of each choice (multiple choice,
    ``input_ids`` (batch, choices, seq)), the ``<s>`` token (sequence classification), else None."""
    sep = model.config.sep_token_id
    if isinstance(model, transformers.RobertaForQuestionAnswering):
        return compute_global_attention_mask(input_ids, sep)
    if isinstance(model, transformers.RobertaForMultipleChoice):
        choices = [compute_global_attention_mask(input_ids[:, i], sep, False) for i in range(input_ids.shape[1])]
        return torch.stack(choices, dim=1)
    if isinstance(model, transformers.RobertaForSequenceClassification):
        mask = torch.zeros_like(input_ids)
        mask[:, 0] = 1
        return mask
    return None
