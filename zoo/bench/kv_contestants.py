"""The contestants of the KV-cache benchmark (:mod:`zoo.bench.kv`): transformers' full cache, the ``budget`` variant
under each policy, the ``longformer`` window with 4 sinks and transformers' ``QuantizedCache`` (quanto), each a dict
(``name``, ``family``, the kept ``budget`` fraction, its settings); :func:`prepare` configures a model for one, and
the cache bytes each holds are counted here.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import QuantizedCache

from zoo.cache import cache_nbytes
from zoo.plug.install import configure

SINKS, RECENT = 4, 64
FULL = {"name": "full cache (transformers)", "family": "full"}
WINDOW = {"name": "longformer window + 4 sinks", "family": "longformer"}
TOVA = {"name": "budget tova", "family": "budget", "policy": "tova"}
TOVA_SLACK = {"name": "budget tova slack 64", "family": "budget", "policy": "tova", "slack": 64}
MEMORY_ROWS = {  # name -> (contestant, chunked prefill)
    "full": (FULL, False),
    "full-chunked": (FULL, True),
    "budget": (TOVA, False),
    "budget-chunked": (TOVA, True),
    "budget-slack-chunked": (TOVA_SLACK, True),
    "window-chunked": (WINDOW, True),
}


def contestants(budgets: list[float], policies: list[str], quantized: bool = True) -> list[dict]:
    """The accuracy table's contestants: the full cache, then per kept fraction every policy and the window, then
    QuantizedCache at 4 and 2 bits."""
    rows = [{**FULL, "budget": 1.0}]
    for fraction in budgets:
        rows += [{"name": f"budget {policy}", "family": "budget", "policy": policy, "budget": fraction}
                 for policy in policies]
        rows.append({**WINDOW, "budget": fraction})
    if quantized:
        rows += [{"name": f"QuantizedCache quanto {bits}-bit", "family": "quantized", "nbits": bits,
                  "budget": bits / 32} for bits in (4, 2)]
    return rows


def prepare(model, contestant: dict, context: int, chunk: int | None = None) -> dict[str, Any]:
    """Configure ``model`` for ``contestant`` at ``context`` tokens (sets ``contestant["tokens"]``, the keys kept per
    layer, None for the full and quantized caches); returns extra generate kwargs."""
    family, kept = contestant["family"], max(SINKS + RECENT, int(contestant["budget"] * context))
    kwargs: dict[str, Any] = {}
    if chunk:
        kwargs["prefill_chunk_size"] = chunk
    if family in ("full", "quantized"):
        model.config._attn_implementation = "sdpa"
        model.set_attn_implementation("sdpa")
        if family == "quantized":
            kwargs["cache"] = QuantizedCache(backend="quanto", config=model.config, nbits=contestant["nbits"],
                                             residual_length=RECENT)
    elif family == "budget":
        configure(model, "budget", tokens=kept, sinks=SINKS, recent=RECENT, policy=contestant["policy"],
                  slack=contestant.get("slack", 0))
    elif family == "longformer":
        configure(model, "longformer", window=2 * (kept - SINKS), global_tokens=list(range(SINKS)))
    contestant["tokens"] = kept if family in ("budget", "longformer") else None
    return kwargs


def quantized_bytes(config, seen: int, nbits: int, residual: int, batch: int, group: int = 64) -> int:
    """Estimated bytes of a QuantizedCache: nbits per value plus an fp32 scale and zero point per group of ``group``
    values for the quantized tokens, fp32 for the residual ones (quanto's tensors are not plain storages)."""
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    per_token = 2 * heads * dim * config.num_hidden_layers * batch  # values of k and v
    quantized = max(0, seen - residual)
    return int(quantized * per_token * (nbits / 8 + 8 / group) + min(seen, residual) * per_token * 4)


def stored_bytes(tensor: Any) -> int:
    """Bytes of a tensor, of a tensor subclass (quanto's packed QBitsTensor) its inner tensors', recursively."""
    if not isinstance(tensor, torch.Tensor):
        return 0
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None and type(tensor) is not torch.Tensor:
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def quantized_cache_bytes(cache) -> int:
    """What a QuantizedCache holds: the quantized keys and values (packed data, scales, zero points) and the
    full-precision residual tokens."""
    return sum(stored_bytes(getattr(layer, name, None)) for layer in cache.layers
               for name in ("_quantized_keys", "_quantized_values", "keys", "values"))


def held_bytes(cache, family: str) -> int:
    """The bytes ``cache`` holds, counted the way its ``family`` stores them."""
    return quantized_cache_bytes(cache) if family == "quantized" else cache_nbytes(cache)
