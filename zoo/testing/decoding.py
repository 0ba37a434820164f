"""Generation checks: greedy decoding with the cache equals the full forward, and a bounded cache stays bounded.
"""

from __future__ import annotations

import torch
import transformers

from zoo.cache import BudgetedLayer, RecurrentLayer, WindowedLayer, cache_nbytes
from zoo.plug.generation import make_cache
from zoo.testing.inputs import tiny_model_config

DECODE_PROMPT_LENGTH = 40  # longer than every test_params window, stride and block of the built-ins
DECODE_NEW_TOKENS = 6


def causal_lm(name: str, **params) -> transformers.PreTrainedModel:
    """A tiny 2-layer Llama (GQA) running variant ``name`` with its ``test_params`` and ``params``, in eval mode,
    its output embeddings scaled so that greedy choices of an untrained model are not ties."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_model_config("llama", name, **params)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def decode_prompts(length: int = DECODE_PROMPT_LENGTH, batch: int = 2, left_pad: int = 5):
    """``input_ids`` (batch, length) and an ``attention_mask`` whose first row is left-padded by ``left_pad``."""
    ids = torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :left_pad] = 0
    return ids, mask


def greedy(model: transformers.PreTrainedModel, ids, mask, new_tokens: int = DECODE_NEW_TOKENS, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                          **kwargs)


def decoding_refusal(model: transformers.PreTrainedModel) -> str | None:
    """The variant's documented refusal to decode with a cache (its ``cache_layer`` raises), or None."""
    try:
        make_cache(model)
    except (ValueError, NotImplementedError) as exc:
        return str(exc)
    return None


def assert_decodes_like_the_full_forward(name: str, **params) -> None:
    """Greedy ``generate`` with the variant's own cache gives the tokens of ``generate(use_cache=False)`` (a full
    forward per step), on a batch with a left-padded row and prompts longer than any window of its
    ``test_params``. A variant whose cache is refused must refuse ``generate`` too (with its message)."""
    model = causal_lm(name, **params)
    ids, mask = decode_prompts()
    with torch.no_grad():
        full = greedy(model, ids, mask, use_cache=False)
        refusal = decoding_refusal(model)
        if refusal is not None:
            try:
                greedy(model, ids, mask)
            except (ValueError, NotImplementedError):
                return
            raise AssertionError(f"{name}: make_cache refuses ({refusal}) but generate with a cache ran")
        cached = greedy(model, ids, mask)
    if not torch.equal(cached, full):
        raise AssertionError(
            f"attention-zoo variant {name!r}: greedy decoding with its cache differs from the full forward "
            f"(left-padded batch, prompt of {ids.shape[-1]} tokens):\ncached {cached[:, ids.shape[-1]:].tolist()}\n"
            f"full   {full[:, ids.shape[-1]:].tolist()}. Its cache drops keys its pattern still reaches, or its "
            "decoding path reads other keys than its pattern."
        )


def declares_bounded_cache(name: str, **params) -> bool:
    """True when the variant decodes with a cache that does not grow with the context (windowed, recurrent or
    budgeted)."""

    config = tiny_model_config("llama", name, **params)
    try:
        cache = make_cache(config)
    except (ValueError, NotImplementedError):
        return False
    return all(isinstance(layer, (WindowedLayer, RecurrentLayer, BudgetedLayer)) for layer in cache.layers)


def assert_cache_bytes_bounded(name: str, lengths: tuple[int, int] = (64, 96), **params) -> None:
    """A bounded cache holds the same bytes after decoding from prompts of two lengths."""

    model = causal_lm(name, **params)
    sizes = []
    for length in lengths:
        with torch.no_grad():
            out = greedy(model, *decode_prompts(length), return_dict_in_generate=True)
        sizes.append(cache_nbytes(out.past_key_values))
    if sizes[0] != sizes[1]:
        raise AssertionError(
            f"attention-zoo variant {name!r} declares a bounded decoding cache, but it holds {sizes[0]} bytes after a "
            f"{lengths[0]}-token prompt and {sizes[1]} after a {lengths[1]}-token one."
        )
