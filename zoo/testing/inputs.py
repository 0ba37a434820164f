"""What the contract suite and a plugin's own tests feed a variant: the variant built with its ``test_params``, random
q/k/v with a padded row, the call, learned weights, tiny model configs and token inputs.
"""

from __future__ import annotations

import torch
import transformers

from zoo.pattern import row_starts
from zoo.plug.install import configure
from zoo.plug.weights import build
from zoo.registry import get_variant_class
from zoo.variant import AttentionCall, Variant

BATCH, HEADS, N, HEAD_DIM = 2, 2, 100, 16
REAL_LENGTH = 73  # real tokens in the second (padded) row
ATOL = 1e-5
MEMORY_CHECK_LENGTH = 4096




def make_variant(name: str, **overrides) -> Variant:
    """Variant ``name`` built with its ``test_params`` (the small settings of the contract suite) and ``overrides``."""
    cls = get_variant_class(name)
    return cls(**{**cls.test_params, **overrides})


def modes(name_or_class: str | type[Variant]) -> list[bool]:
    """The ``causal`` values the variant supports: [False, True], [False] or [True]."""
    cls = get_variant_class(name_or_class) if isinstance(name_or_class, str) else name_or_class
    return [c for c, ok in ((False, cls.supports_bidirectional), (True, cls.supports_causal)) if ok]


def make_inputs(
    seed: int = 0,
    dtype=torch.float32,
    n: int = N,
    padding: str | None = "right",
    batch: int = BATCH,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
):
    """``q, k, v`` (batch, heads, n, head_dim) ~ N(0, 1) and a padding mask (batch, n) bool with the last row holding
    ``REAL_LENGTH`` (at most n - 1) real tokens on the right (``padding="right"``) or on the left; None when
    ``padding`` is None."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen).to(dtype) for _ in range(3))
    mask = None
    if padding is not None:
        mask = torch.ones(batch, n, dtype=torch.bool)
        real = min(REAL_LENGTH, n - 1)
        if padding == "right":
            mask[-1, real:] = False
        else:
            mask[-1, : n - real] = False
    return q, k, v, mask


def make_call(
    causal: bool, padding_mask=None, head_dim: int = HEAD_DIM, variant: Variant | None = None, heads: int = HEADS,
    dtype: torch.dtype = torch.float32, **kwargs,
) -> AttentionCall:
    """An :class:`AttentionCall` with softmax scaling ``head_dim ** -0.5``; ``kwargs`` set the other fields.
    With ``variant``, the call carries that variant's learned weights (:func:`make_weights` for ``heads`` x
    ``head_dim``, in ``dtype`` as in a model of that dtype) when it declares any."""
    if variant is not None and "weights" not in kwargs:
        weights = make_weights(variant, heads=heads, head_dim=head_dim)
        kwargs["weights"] = weights.to(dtype) if weights is not None else None
    kwargs.setdefault("row_start", row_starts(padding_mask))  # as the plug sets it: where each row's tokens start
    return AttentionCall(causal=causal, scaling=head_dim**-0.5, padding_mask=padding_mask, **kwargs)


def make_weights(
    variant: Variant, heads: int = HEADS, head_dim: int = HEAD_DIM, layer_idx: int = 0,
    max_positions: int = MEMORY_CHECK_LENGTH,
) -> torch.nn.Module | None:
    """The variant's learned weights for one layer (None if it declares none), built as in a model (seeded per
    layer, so every call returns the same values) for a BERT config of ``heads`` x ``head_dim`` with
    ``max_positions`` positions."""
    hidden = heads * head_dim
    config = transformers.BertConfig(
        hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=1, intermediate_size=2 * hidden,
        max_position_embeddings=max_positions,
    )
    return build(variant, layer_idx, config, head_dim, heads)


def declares_weights(variant: Variant) -> bool:
    """True when the variant, at its current parameters, has learned per-layer weights (parameters; a module holding
    only buffers, such as performer's redraw counter, has none to train)."""
    weights = make_weights(variant)
    return weights is not None and any(True for _ in weights.parameters())


DECODER_FAMILIES = {  # rotary decoders with grouped key/value heads
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
}
def tiny_model_config(family: str, name: str, **params) -> transformers.PretrainedConfig:
    """A 2-layer, hidden-32 ``bert``, ``modernbert``, ``llama``, ``mistral`` or ``qwen2`` (GQA) config using variant
    ``name`` with its ``test_params`` and ``params``."""
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if family == "bert":
        config = transformers.BertConfig(**common, attention_probs_dropout_prob=0.0, max_position_embeddings=256)
    elif family == "modernbert":
        config = transformers.ModernBertConfig(
            **common, attention_dropout=0.0, global_attn_every_n_layers=2, local_attention=16, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        )
    elif family in DECODER_FAMILIES:
        config = DECODER_FAMILIES[family](**common, num_key_value_heads=2, attention_dropout=0.0, pad_token_id=0)
    else:
        raise ValueError(
            f"tiny_model_config: unknown family {family!r}; use 'bert', 'modernbert' or one of "
            f"{list(DECODER_FAMILIES)}."
        )
    return configure(config, name, **{**get_variant_class(name).test_params, **params})


def model_inputs(n: int = N, batch: int = BATCH, vocab_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` (batch, n) and an ``attention_mask`` whose last row is padded after ``REAL_LENGTH`` tokens."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (batch, n), generator=gen)
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[-1, min(REAL_LENGTH, n - 1) :] = 0
    return ids, mask
