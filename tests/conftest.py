"""Test setup: no Hub, and the third-party plugin fixture installed (with pip, into a private target
directory put on sys.path) before the registry looks for entry points."""

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PLUGIN_SRC = Path(__file__).parent / "plugin_fixture"


def install_plugin_fixture(source: Path, package: str) -> Path:
    """pip-install the fixture package at ``source`` into a private folder (once per content) and return it."""
    digest = hashlib.sha256()
    for path in sorted(source.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path):
            digest.update(path.read_bytes())
    target = Path(tempfile.gettempdir()) / f"attention-zoo-{source.name}-{digest.hexdigest()[:12]}"
    if not (target / package).exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
             "--target", str(target), str(source)],
            check=True,
        )
    return target


PLUGIN_TARGET = install_plugin_fixture(PLUGIN_SRC, "zoo_chunked_plugin")
sys.path.insert(0, str(PLUGIN_TARGET))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN_TARGET), os.environ.get("PYTHONPATH")]))


def outputs_and_gradients(attention, inputs, grad_out) -> list:
    """``attention(*inputs)`` and the gradients of ``(out * grad_out).sum()`` for each input, on fresh leaves."""
    import torch

    leaves = [x.clone().requires_grad_() for x in inputs]
    out = attention(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


@pytest.fixture(scope="session")
def tiny_smollm2_llama(tmp_path_factory):
    """A factory: a tiny random Llama (hidden 64, ``layers`` layers) with SmolLM2's tokenizer, saved to a folder."""
    import torch
    import transformers

    from zoo.data.pretrained import smollm2_folder

    def make(layers: int = 2, max_positions: int = 4096) -> Path:
        tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_folder())
        config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=max_positions, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        folder = tmp_path_factory.mktemp("tiny") / "model"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder

    return make
