#!/usr/bin/env bash
# One prepared GPU check (sized for <= 8 minutes on one GPU): the Flex tests on CUDA (forward + backward of every
# exact pattern variant against its chunked kernel), the contract suite, `zoo bench` bf16 fwd+bwd at 8K and 32K for
# each exact variant on Flex against dense SDPA (flash) and transformers' Longformer/BigBird in the same run, the
# chunked kernels on CUDA for comparison, the decode bench at 32K, and one markdown table at the end.
#
#   bash scripts/gpu_check.sh            # writes runs/gpu/, prints runs/gpu/summary.md
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT_DIR:-runs/gpu}
mkdir -p "$OUT"
status=0

step() { echo; echo "== $1 ($(date +%T))"; }

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

step "Flex tests on CUDA (forward + backward vs the chunked kernels) and the contract suite"
timeout 140 "$PY" -m pytest -q -x tests/test_flex.py tests/test_contract.py -p no:cacheprovider \
  2>&1 | tail -n 15 | tee "$OUT/tests.txt" || status=1

VARIANTS="longformer bigbird sparse_transformer xformers sdpa hf_longformer hf_bigbird"
COMMON="--device cuda --dtype bf16 --mode fwd+bwd --lengths 8192 32768 --repeats 3 --warmup 1 --no_progress
        --variant_params xformers.window=512"

step "zoo bench: exact variants on Flex vs dense SDPA and transformers' Longformer/BigBird"
# shellcheck disable=SC2086
timeout 180 "$PY" -m zoo.cli bench --variants $VARIANTS $COMMON --backend flex --max_seconds 60 \
  --output_dir "$OUT/bench-flex" || status=1

step "zoo bench: the same variants on their chunked kernels (the CUDA fallback before Flex)"
# shellcheck disable=SC2086
timeout 90 "$PY" -m zoo.cli bench --variants longformer bigbird sparse_transformer $COMMON --backend chunked \
  --max_seconds 15 --output_dir "$OUT/bench-chunked" || status=1

step "decode bench at 32K"
timeout 60 "$PY" -m zoo.cli bench --decode --device cuda --lengths 32768 --no_progress \
  --output_dir "$OUT/decode" || status=1

step "summary"
{
  echo "# GPU check ($(cat "$OUT/gpu.txt"), $(date -u +%F))"
  for part in bench-flex/bench.md bench-chunked/bench.md decode/decode.md; do
    echo
    echo "## ${part%%/*}"
    cat "$OUT/$part" 2>/dev/null || echo "(missing: that step failed or timed out, see the log above)"
  done
  echo
  echo "## tests"
  echo '```'
  cat "$OUT/tests.txt"
  echo '```'
} > "$OUT/summary.md"
cat "$OUT/summary.md"
exit $status
