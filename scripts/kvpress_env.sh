#!/usr/bin/env bash
# Build a second environment with NVIDIA kvpress 0.5.5, which pins transformers<5.3 (on 5.24 every press fails with
# KeyError: 'past_key_values'), for scripts/kvpress_peer.py: the kvpress peer of `zoo eval` (zoo/eval/run.py runs
# `.venv-kvpress/bin/python scripts/kvpress_peer.py --eval RUN_DIR ...` when this environment exists) and of the
# passkey benchmark (zoo/bench/kv.py, `--out results/bench/kv`).
# Usage: scripts/kvpress_env.sh [VENV]   (default .venv-kvpress; idempotent)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-kvpress}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
# torch pinned to the CPU build this machine has on disk (an unpinned torch pulls a multi-GB CUDA build).
$PIP install -q "torch==2.13.0" "transformers==5.2.0" "kvpress==0.5.5" accelerate
$VENV/bin/python -c "import kvpress, transformers, torch; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'transformers', transformers.__version__, 'torch', torch.__version__)"
