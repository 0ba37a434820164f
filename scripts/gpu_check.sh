#!/usr/bin/env bash
# The prepared GPU check, for one run on the GPU machine (one H200, its own python3 3.12 with torch 2.11.0+cu130,
# no network): the wheels from scripts/gpu_wheels.sh installed into a target folder that PYTHONPATH puts first
# (transformers 5.24 over the machine's 5.17, the project itself), then the environment, the Flex tests on CUDA
# (forward + backward against the chunked kernels), `zoo bench` bf16 fwd+bwd at 8K and 32K for every exact pattern
# variant on Flex against dense SDPA and transformers' Longformer/BigBird, the same variants on their chunked
# kernels, the fla backend's CUDA tests (flash-linear-attention's kernels against the zoo's chunked recurrent
# kernels, and fla's NSA selected-block kernel against the zoo's), `zoo bench` bf16 fwd+bwd at 8K and 32K of the
# recurrent variants on fla, then on the zoo's kernels (ATTENTION_ZOO_FLA=0), the same for the content-chosen sparse
# variants (moba, nsa, dsa) against sdpa and longformer, and FOLDER/summary.md: each step's status, exit code,
# seconds and log, then its key table. Each step runs under its own timeout (budgets sum to 560 s, under the device's
# 600 s a command); a failed step never stops the next. Decoding is measured on the CPU (`zoo bench --decode`), not
# here: that bench runs on the CPU only.
#
#   bash scripts/gpu_check.sh [FOLDER]              # on the GPU machine, with .whl/ carried along with the tree
#   bash scripts/gpu_check.sh --rehearse [FOLDER]   # anywhere, no GPU: every step resolved, nothing measured
#   bash scripts/gpu_check.sh --steps=fla-tests,bench-sparse   # install, env and the steps named, in their order
#
# The first run on an H200 (2026-12-04) needed more than one 600 s call: compiling Flex for 7 contestants and fla's
# kernels for 3 outran their budgets; --steps splits the check over calls.
# FOLDER: default $OUT (the device tool's; the files are then packed into summary.md and gpu-check.tar.gz, since
# at most 8 files come back from there; --pack does the same elsewhere), else runs/gpu. Python: $PYTHON, else
# python3 (a rehearsal takes .venv/bin/python when python3 has no torch). Wheels: $GPU_CHECK_WHEELS, else .whl.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
MODE=run PACK=0 DIR= ONLY=
for arg in "$@"; do
  case $arg in
    --rehearse) MODE=rehearse ;;
    --pack) PACK=1 ;;
    --steps=*) ONLY=${arg#--steps=} ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg" >&2; usage >&2; exit 2 ;;
    *) DIR=$arg ;;
  esac
done
if [ -z "$DIR" ] && [ -n "${OUT:-}" ]; then DIR=$OUT PACK=1; fi
DIR=${DIR:-runs/gpu}
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ "$MODE" = rehearse ] && ! python3 -c "import torch" 2>/dev/null && [ -x .venv/bin/python ]; then
  PY=$PWD/.venv/bin/python
else
  PY=python3
fi
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd) || { echo "gpu_check: cannot create $DIR" >&2; exit 2; }
SITE=$(mktemp -d "${TMPDIR:-/tmp}/attention-zoo-gpu-site.XXXXXX") || exit 2
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/attention-zoo-gpu-scratch.XXXXXX") || exit 2
trap 'rm -rf "$SITE" "$SCRATCH"' EXIT

WHEELS=${GPU_CHECK_WHEELS:-.whl}
export MODE PY DIR SITE SCRATCH WHEELS
# offline; unbuffered logs; the carried packages first; never the tree's zoo/ from the current folder (PYTHONSAFEPATH:
# the tree lacks zoo.variants, which the project wheel maps from variants/); pip (the tests' plugin fixture) offline
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

STEPS=(install env flex-tests bench-flex-8k bench-flex-32k bench-chunked fla-tests bench-recurrent bench-sparse)
declare -A BUDGET=([install]=15 [env]=30 [flex-tests]=85 [bench-flex-8k]=65 [bench-flex-32k]=70
  [bench-chunked]=50 [fla-tests]=100 [bench-recurrent]=80 [bench-sparse]=65)
declare -A TITLE=(
  [install]="the carried wheels (.whl/) installed into a target folder, the project wheel checked against the tree"
  [env]="GPU, versions and where each package comes from, FlexAttention's API, unmet requirements"
  [flex-tests]="tests/test_flex.py on CUDA: Flex forward + backward against the chunked kernels, fp32 and bf16"
  [bench-flex-8k]="zoo bench bf16 fwd+bwd, n = 8192: exact variants on Flex, dense SDPA, transformers' peers"
  [bench-flex-32k]="the same at n = 32768"
  [bench-chunked]="zoo bench bf16 fwd+bwd, n = 8192, 32768: the same variants on their chunked kernels (xformers: its own)"
  [fla-tests]="tests/variants/test_fla_backend.py on CUDA: fla's kernels against the zoo's recurrent kernels, fwd + bwd"
  [bench-recurrent]="zoo bench bf16 fwd+bwd, n = 8192, 32768: recurrent variants on fla, then on the zoo's kernels"
  [bench-sparse]="zoo bench bf16 fwd+bwd causal, n = 8192, 32768: moba, nsa, dsa against sdpa and longformer")

FLEX_CUDA_TESTS=tests/test_flex.py::test_cuda_flex_forward_and_backward_equal_the_chunked_kernel
FLA_CUDA_TESTS="tests/variants/test_fla_nsa.py tests/variants/test_fla_backend.py -k test_cuda_"
EXACT="longformer bigbird sparse_transformer xformers"
BENCH="--device cuda --dtype bf16 --mode fwd+bwd --repeats 3 --warmup 1 --no_progress --variant_params xformers.window=512"
# the recurrent variants (causal only): the same run on fla's kernels (CUDA bf16: the default when fla is installed)
# and on the zoo's chunked kernels (ATTENTION_ZOO_FLA=0), dense SDPA once as the yardstick
RECURRENT_VARIANTS="deltanet gated_deltanet gla"
RECURRENT="--causal --device cuda --dtype bf16 --mode fwd+bwd --repeats 2 --warmup 1 --no_progress --lengths 8192 32768
  --max_seconds 15"
# the content-chosen sparse variants on the zoo's kernels (12 heads, no GQA: nsa's selected branch stays on the zoo's)
SPARSE="--variants moba nsa dsa sdpa longformer --causal --device cuda --dtype bf16 --mode fwd+bwd --repeats 2
  --warmup 1 --no_progress --lengths 8192 32768 --max_seconds 12"
export FLEX_CUDA_TESTS FLA_CUDA_TESTS EXACT BENCH RECURRENT_VARIANTS RECURRENT SPARSE
PLATFORM="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
export PLATFORM

# --------------------------------------------------------------------------------------------------------------
# the steps: each runs in its own shell under `timeout`, its output in logs/STEP.log, its files in FOLDER/STEP/

step_install() {
  local carried=("$WHEELS"/*.whl) install
  if [ ! -e "${carried[0]}" ] && [ "$MODE" = run ]; then
    echo "no $WHEELS/*.whl: run scripts/gpu_wheels.sh where PyPI is reachable and carry .whl with the tree"
    return 1
  elif [ ! -e "${carried[0]}" ]; then
    echo "no $WHEELS/*.whl (scripts/gpu_wheels.sh not run here): the rehearsal builds the project wheel itself"
    rm -rf build  # files an earlier build left in build/lib would go into the wheel
    "$PY" -m pip wheel -q --no-deps --no-build-isolation . -w "$SCRATCH/wheel" || return 1
    install=("$SCRATCH"/wheel/*.whl)
  elif [ "$MODE" = rehearse ]; then
    echo "pip on the GPU machine (cp312, manylinux x86_64) accepts every carried wheel:"
    # shellcheck disable=SC2086
    "$PY" -m pip install --dry-run --ignore-installed --no-deps --only-binary=:all: $PLATFORM \
      --target "$SCRATCH/dry" "${carried[@]}" || return 1
    install=("$WHEELS"/attention_zoo-*.whl "$WHEELS"/transformers-*.whl)  # what the steps import; xformers, fla: GPU only
  else
    install=("${carried[@]}")
  fi
  echo "installing into $SITE: ${install[*]##*/}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${install[@]}" || return 1
  "$PY" scripts/gpu_tools.py fresh "$SITE"
}

step_env() {
  local rc
  if [ "$MODE" = run ]; then
    nvidia-smi
    "$PY" scripts/gpu_tools.py env --site "$SITE" --out "$DIR/env/env.md"
    rc=$?
    timeout 15 "$PY" -m xformers.info 2>&1 | head -n 80  # which of xformers' operators run here (hung once: 30 s)
    return $rc
  fi
  "$PY" scripts/gpu_tools.py env --site "$SITE" --out "$DIR/env/env.md" --rehearse
}

cuda_tests() {  # step $1 runs pytest on the rest (a selection); a rehearsal collects them only
  local step=$1 rc
  shift
  if [ "$MODE" = rehearse ]; then
    "$PY" -m pytest -p no:cacheprovider --collect-only -q "$@"
    return
  fi
  "$PY" -m pytest -p no:cacheprovider -v -rA "$@" --junitxml "$DIR/$step/junit.xml"
  rc=$?
  if grep -q "^SKIPPED" "$DIR/logs/$step.log"; then echo "tests were skipped: no CUDA (or no fla)?"; return 1; fi
  return $rc
}
step_flex_tests() { cuda_tests flex-tests "$FLEX_CUDA_TESTS"; }
# shellcheck disable=SC2086  # a word list
step_fla_tests() { cuda_tests fla-tests $FLA_CUDA_TESTS; }

zoo_bench() {  # the installed project's `zoo bench`; a rehearsal checks the arguments only
  local dry=()
  [ "$MODE" = rehearse ] && dry=(--dry_run)
  "$PY" scripts/gpu_tools.py zoo bench "$@" "${dry[@]}"
}
# shellcheck disable=SC2086  # $EXACT and $BENCH are word lists
step_bench_flex_8k() {
  zoo_bench --variants $EXACT sdpa hf_longformer hf_bigbird $BENCH --backend flex --lengths 8192 --max_seconds 30 \
    --output_dir "$DIR/bench-flex-8k"
}
step_bench_flex_32k() {
  zoo_bench --variants $EXACT sdpa hf_longformer hf_bigbird $BENCH --backend flex --lengths 32768 --max_seconds 60 \
    --output_dir "$DIR/bench-flex-32k"
}
step_bench_chunked() {
  zoo_bench --variants $EXACT sdpa $BENCH --backend chunked --lengths 8192 32768 --max_seconds 15 \
    --output_dir "$DIR/bench-chunked"
}
step_bench_recurrent() {
  local rc=0 out=$DIR/bench-recurrent
  zoo_bench --variants $RECURRENT_VARIANTS sdpa $RECURRENT --output_dir "$out/fla" || rc=1
  ATTENTION_ZOO_FLA=0 zoo_bench --variants $RECURRENT_VARIANTS $RECURRENT --output_dir "$out/zoo" || rc=1
  return $rc
}
# shellcheck disable=SC2086
step_bench_sparse() { zoo_bench $SPARSE --output_dir "$DIR/bench-sparse"; }
export -f step_install step_env cuda_tests step_flex_tests zoo_bench step_bench_flex_8k step_bench_flex_32k \
  step_bench_chunked step_fla_tests step_bench_recurrent step_bench_sparse

# --------------------------------------------------------------------------------------------------------------
# running them, and the summary

now() { date +%s.%N; }
rm -rf "$DIR/summary.md" "$DIR/steps.tsv" "$DIR/logs" "$DIR/gpu-check.tar.gz"
mkdir -p "$DIR/logs"
echo "gpu_check ($MODE): $PY into $DIR, $(date -u '+%F %T') UTC"

run_step() {
  local name=$1 budget=${BUDGET[$1]} log=logs/$1.log limit start rc status seconds
  limit=$budget
  [ "$MODE" = rehearse ] && limit=180  # a rehearsal's steps are short, but a busy 2-core machine can slow them
  echo
  echo "== $name (budget $budget s): ${TITLE[$name]}"
  rm -rf "${DIR:?}/$name"
  start=$(now)
  if ! mkdir -p "$DIR/$name" || ! touch "$DIR/$name/.writable" "$DIR/$log"; then
    rc=1 status="failed: $DIR/$name is not writable"
  else
    rm -f "$DIR/$name/.writable"
    timeout -k 10 "$limit" bash -c "step_${name//-/_}" > "$DIR/$log" 2>&1
    rc=$?
    case $rc in 0) status=ok ;; 124 | 137) status="timed out" ;; *) status=failed ;; esac
  fi
  seconds=$(awk -v a="$start" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$seconds" "$budget" >> "$DIR/steps.tsv"
  echo "   $status (exit $rc) in $seconds s; log: $log"
  [ "$rc" = 0 ] || tail -n 5 "$DIR/$log" | sed 's/^/   | /'
}

section() {  # the markdown sections of $1 whose headings start with the later arguments, one level down, no images
  local file=$1
  shift
  [ -f "$file" ] || return 1
  awk -v heads="$(IFS='|'; echo "$*")" '
    BEGIN { n = split(heads, h, "|") }
    /^## / { on = 0; for (i = 1; i <= n; i++) if (index($0, "## " h[i]) == 1) on = 1; if (on) $0 = "#" $0 }
    on && !/^!\[/' "$file"
}

key_table() {  # what one step produced that matters, in markdown
  local name=$1 log=$DIR/logs/$1.log
  case $name in
    install) grep -E "^(installing|gpu_tools|no |pip on)" "$log" ;;
    env) cat "$DIR/env/env.md" 2>/dev/null ;;
    flex-tests | fla-tests)
      if [ "$MODE" = rehearse ]; then grep -E "tests? collected|error" "$log"; return; fi
      echo "| test | result |"
      echo "|---|---|"
      # pytest -v writes each test's id when it starts and its outcome when it ends: a cut-off test shows as such
      awk '/^tests\/[^ ]*::/ { split($1, id, "::"); outcome = $2 ~ /^[A-Z]+$/ ? $2 : "unfinished (the step ended)"
                               print "| " id[2] " | " outcome " |" }' "$log"
      grep -E "^=+ .*(passed|failed|error).* =+$" "$log" | tail -n 1
      ;;
    bench-recurrent)
      if [ "$MODE" = rehearse ]; then grep "^zoo bench --dry_run" "$log"; return; fi
      for kernels in fla zoo; do
        echo "**On $kernels's kernels** ($name/$kernels/bench.md):"
        echo
        section "$DIR/$name/$kernels/bench.md" "Time (s)" "Peak memory" "Errors" || echo "(no bench.md)"
        echo
      done ;;
    bench-*)
      if [ "$MODE" = rehearse ]; then grep "^zoo bench --dry_run" "$log"; return; fi
      section "$DIR/$name/bench.md" "Time (s)" "Peak memory" "Against sdpa" "Against the matching peer" "Errors" ;;
  esac
}

render_summary() {
  local name status rc seconds budget total=0 failed=0
  echo "# GPU check$([ "$MODE" = rehearse ] && echo ": rehearsal (nothing measured)"), $(date -u '+%F %H:%M') UTC"
  echo
  echo "Python: \`$PY\`; packages first from the carried wheels; folder: \`$DIR\`."
  echo
  echo "| step | status | exit | seconds | budget s | log |"
  echo "|---|---|---|---|---|---|"
  while IFS=$'\t' read -r name status rc seconds budget; do
    echo "| $name | $status | $rc | $seconds | $budget | logs/$name.log |"
    total=$((total + budget))
    [ "$rc" = 0 ] || failed=$((failed + 1))
  done < "$DIR/steps.tsv"
  echo
  echo "$failed of ${#STEPS[@]} steps failed; budgets sum to $total s."
  while IFS=$'\t' read -r name status rc seconds budget; do
    echo
    echo "## $name: $status"
    echo
    echo "${TITLE[$name]}."
    echo
    key_table "$name" || echo "(no table: the step produced none; see logs/$name.log)"
    if [ "$rc" != 0 ]; then
      echo
      echo "Last lines of logs/$name.log:"
      echo
      echo '```'
      tail -n 15 "$DIR/logs/$name.log"
      echo '```'
    fi
  done < "$DIR/steps.tsv"
}

if [ -n "$ONLY" ]; then
  chosen=(install env)
  for name in "${STEPS[@]}"; do
    [[ ",$ONLY," == *",$name,"* && $name != install && $name != env ]] && chosen+=("$name")
  done
  for name in ${ONLY//,/ }; do
    [ -n "${BUDGET[$name]:-}" ] || { echo "gpu_check: no step $name (steps: ${STEPS[*]})" >&2; exit 2; }
  done
  STEPS=("${chosen[@]}")
fi
for name in "${STEPS[@]}"; do run_step "$name"; done
render_summary > "$DIR/summary.md"
failed=$(awk -F '\t' '$3 != 0' "$DIR/steps.tsv" | wc -l)
if [ "$PACK" = 1 ]; then
  tar -czf "$DIR/gpu-check.tar.gz" -C "$DIR" steps.tsv logs "${STEPS[@]}" && rm -rf "$DIR/steps.tsv" "$DIR/logs" \
    "${STEPS[@]/#/$DIR/}"
fi
echo
cat "$DIR/summary.md"
[ "$failed" = 0 ]
