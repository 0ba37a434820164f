"""Reload checks: a model saved and loaded back gives the same output; learned attention weights train and reload.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers

from zoo.plug.spec import IMPLEMENTATION, variant_spec
from zoo.plug.weights import WEIGHTS_NAME


def assert_reloads_identically(
    model: transformers.PreTrainedModel, inputs: dict, path: str | Path | None = None, **compare
) -> transformers.PreTrainedModel:
    """Save ``model`` (put in eval mode) with ``save_pretrained``, load it back with ``from_pretrained`` of the same
    class, check it uses the same variant and parameters and gives the same first output (``last_hidden_state``
    or ``logits``) on ``inputs``; returns the reloaded model. ``path``: where to save (default a temporary folder);
    ``compare``: tolerances for ``torch.testing.assert_close``."""
    model.eval()
    with torch.no_grad():
        before = model(**inputs)[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(path if path is not None else tmp)
        model.save_pretrained(folder)
        reloaded = type(model).from_pretrained(folder).eval()
    saved, loaded = variant_spec(model.config), variant_spec(reloaded.config)
    if saved is not None:
        if loaded is None or (loaded["variant"], loaded["params"]) != (saved["variant"], saved["params"]):
            raise AssertionError(f"the reloaded model's attention-zoo entry {loaded} differs from the saved {saved}")
        if reloaded.config._attn_implementation != IMPLEMENTATION:
            raise AssertionError(f"the reloaded model runs {reloaded.config._attn_implementation!r}, not the zoo")
    with torch.no_grad():
        after = reloaded(**inputs)[0]
    torch.testing.assert_close(after, before, msg=lambda m: f"reloaded model's output differs: {m}", **compare)
    return reloaded


def assert_weights_train_and_reload(model: transformers.PreTrainedModel, inputs: dict) -> None:
    """The variant's learned weights in ``model`` are parameters the optimizer sees, every one gets a finite, nonzero
    gradient, and after a change (as training makes) ``save_pretrained`` / ``from_pretrained`` restores them exactly
    and the outputs with them."""
    named = {key: p for key, p in model.named_parameters() if f".{WEIGHTS_NAME}." in f".{key}"}
    if not named:
        raise AssertionError(f"{type(model).__name__} has no {WEIGHTS_NAME!r} parameters: make_module returned None?")
    model.train()
    out = model(**inputs)[0]
    (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
    for key, param in named.items():
        if param.grad is None or not torch.isfinite(param.grad).all() or param.grad.abs().max() == 0:
            raise AssertionError(f"learned weight {key} gets no (finite, nonzero) gradient: {param.grad}")
    with torch.no_grad():
        for param in named.values():
            param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)).to(param))
    reloaded = assert_reloads_identically(model, inputs)
    state = reloaded.state_dict()
    for key, param in named.items():
        torch.testing.assert_close(state[key], param.detach(), atol=0, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
