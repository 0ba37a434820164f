"""The contestants of ``zoo eval`` on one model: configure the model for one (the KV benchmark's
:func:`zoo.bench.kv_contestants.prepare` for the full cache, ``budget``, the window and QuantizedCache; any zoo variant;
a saved folder, loaded as a model of its own), and load the model a run evaluates.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, QuantizedCache

from zoo.bench.kv_contestants import RECENT, SINKS, held_bytes, prepare
from zoo.data.pretrained import smollm2_folder
from zoo.eval.config import SHARED_FAMILIES
from zoo.plug.generation import make_cache
from zoo.plug.install import configure

BUNDLED = {"smollm2": ("HuggingFaceTB/SmolLM2-135M-Instruct", smollm2_folder)}  # name -> (Hub id, its folder)


def model_path(name: str) -> str:
    """The folder or Hub id ``from_pretrained`` reads for a config's ``model``: a bundled name (``smollm2``, offline)
    gives its converted folder, anything else is a folder or Hub id already."""
    return str(BUNDLED[name][1]()) if name in BUNDLED else name


def hub_id(name: str) -> str:
    """The Hub id a model card names as ``base_model`` for a config's ``model`` (a bundled name: its original)."""
    return BUNDLED[name][0] if name in BUNDLED else name


def load_model(name: str, device: str | None = None, dtype: str | None = None):
    """``(model, tokenizer)`` of ``name`` (:func:`model_path`: ``smollm2`` or a folder or Hub id;
    ``AutoModelForCausalLM.from_pretrained``; import the zoo first so that a saved zoo variant reloads with it), on
    ``device`` (default CPU) in ``dtype`` (default the checkpoint's, fp32 for SmolLM2)."""
    options = {"dtype": getattr(torch, dtype)} if dtype else {}
    path = model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, **options).eval()
    return (model.to(device) if device else model), AutoTokenizer.from_pretrained(path)


def kept_fraction(contestant: dict[str, Any], length: int) -> float:
    """The share of ``length`` keys ``contestant`` keeps (its ``budget``, or ``tokens / length``; 1 without a bound)."""
    if "budget" in contestant:
        return float(contestant["budget"])
    if "tokens" in contestant:
        return min(1.0, contestant["tokens"] / length)
    return 1.0


def configure_for(model, contestant: dict[str, Any], length: int) -> dict[str, Any]:
    """Configure ``model`` for ``contestant`` at prompts of ``length`` tokens; returns extra ``generate`` kwargs."""
    family = contestant["family"]
    if family == "variant":
        configure(model, contestant["variant"], **contestant.get("params", {}))
        return {}
    if family == "folder":
        return {}
    # a budget keeps the variant's default slack unless the config names one (the KV benchmark's own default is 0)
    as_kv = {"slack": None, **contestant, "family": "longformer" if family == "window" else family,
             "budget": kept_fraction(contestant, length)}
    kwargs = prepare(model, as_kv, length)
    contestant["tokens_kept"] = as_kv.get("tokens")
    return kwargs


def shares_prefill(contestant: dict[str, Any]) -> bool:
    """Whether the contestant's prefill is the full model's (so one prefill serves it, :func:`shared_generate`)."""
    return contestant["family"] in SHARED_FAMILIES


def fresh_cache(model, contestant: dict[str, Any]):
    """The cache a contestant decodes with, for loops of our own (perplexity): a DynamicCache for the full model,
    QuantizedCache, else the zoo's cache for the configured variant."""
    family = contestant["family"]
    if family == "full" or (family == "folder" and not hasattr(model.config, "attention_zoo")):
        return DynamicCache()
    if family == "quantized":
        return QuantizedCache(backend="quanto", config=model.config, nbits=contestant["nbits"],
                              residual_length=RECENT)
    return make_cache(model)


def cache_bytes(cache, contestant: dict[str, Any]) -> int:
    """Bytes ``cache`` holds, counted as its family stores them (QuantizedCache: its packed tensors)."""
    return held_bytes(cache, "quantized" if contestant["family"] == "quantized" else "zoo")


def as_kv_job(contestant: dict[str, Any], length: int) -> dict[str, Any]:
    """The KV benchmark's job dict for a shared-prefill contestant (:func:`zoo.bench.kv_accuracy.shared_generate`)."""
    return {**contestant, "budget": kept_fraction(contestant, length)}


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new_tokens: int, pad_token_id: int, **kwargs) -> tuple[torch.Tensor, Any]:
    """Greedy tokens after ``ids`` (one batch, no padding) until every row has ended its answer (end of sequence)
    or ``new_tokens`` were made: (new token ids, the cache)."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=pad_token_id,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], out.past_key_values


__all__ = ["SINKS", "as_kv_job", "cache_bytes", "configure_for", "fresh_cache", "greedy", "hub_id", "kept_fraction",
           "load_model", "model_path", "shares_prefill"]
