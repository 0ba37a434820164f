#!/usr/bin/env bash
# The prepared GPU check, for the GPU machine (one H100 or H200, its own python3 3.12 with torch 2.11.0+cu130 and
# triton 3.6, no network): the wheels from scripts/gpu_wheels.sh installed into a target folder that PYTHONPATH puts
# first (transformers 5.24 over the machine's 5.17, the project itself), the environment, then five measuring steps,
# each under 8 minutes and each writing its own folder FOLDER/STEP/, in this order:
#   (a) cuda-tests       every test_cuda_* test: Flex forward + backward against the chunked kernels (pattern variants,
#                        moba, nsa), dsa's Triton kernels against the zoo's, fla's kernels against the zoo's recurrent
#                        kernels and nsa's selected blocks
#   (b) bench-patterns   `zoo bench` bf16 fwd+bwd at 8K, 16K, 32K: every exact pattern variant on Flex, then on its
#                        chunked kernel (xformers: its own), each run beside dense (flash) SDPA
#   (c) bench-content    the same for moba, nsa (Flex) and dsa (its Triton kernels), then on the zoo's kernels
#                        (--backend chunked, ATTENTION_ZOO_TRITON=0)
#   (d) bench-recurrent  the recurrent variants on fla, then on the zoo's kernels (ATTENTION_ZOO_FLA=0)
#   (e) decode           decoding at 8K-32K: `zoo bench --decode` measures on the CPU only (zoo/bench/decode.py
#                        refuses --device cuda), so this step records that refusal and measures nothing; decoding
#                        figures come from CPU runs (results/bench/decode_sparse/). Should the bench take CUDA one day,
#                        the step runs it.
# and FOLDER/summary.md: each step's status, exit code, seconds and log, then its key table. Each step runs under its
# own timeout; a failed step never stops the next. The steps together outrun the device's 600 s a command: run one
# step per call (install and env come with each, 45 s), e.g. --steps=cuda-tests, then --steps=bench-patterns...
#
#   bash scripts/gpu_check.sh --steps=cuda-tests [FOLDER]   # on the GPU machine, .whl/ carried along with the tree
#   bash scripts/gpu_check.sh [FOLDER]              # every step in one go (over 600 s: not on the device tool)
#   bash scripts/gpu_check.sh --rehearse [FOLDER]   # anywhere, no GPU: every step resolved, nothing measured
#
# The first run on an H200 (2026-12-04) needed more than one 600 s call: compiling Flex for 7 contestants and fla's
# kernels for 3 outran their budgets; hence one step per call.
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

STEPS=(install env cuda-tests bench-patterns bench-content bench-recurrent decode)
declare -A BUDGET=([install]=15 [env]=30 [cuda-tests]=330 [bench-patterns]=470 [bench-content]=470
  [bench-recurrent]=240 [decode]=30)
declare -A TITLE=(
  [install]="the carried wheels (.whl/) installed into a target folder, the project wheel checked against the tree"
  [env]="GPU, versions and where each package comes from, FlexAttention's API, unmet requirements"
  [cuda-tests]="(a) every test_cuda_* test: Flex (pattern variants, moba, nsa), dsa's Triton kernels and fla's kernels against the zoo's, forward + backward"
  [bench-patterns]="(b) zoo bench bf16 fwd+bwd, n = 8K, 16K, 32K: the exact pattern variants on Flex, then on their chunked kernels (xformers: its own), beside dense SDPA"
  [bench-content]="(c) zoo bench bf16 fwd+bwd causal, n = 8K, 16K, 32K: moba, nsa on Flex and dsa on its Triton kernels, then all three on the zoo's kernels, beside dense SDPA"
  [bench-recurrent]="(d) zoo bench bf16 fwd+bwd causal, n = 8K, 16K, 32K: the recurrent variants on fla, then on the zoo's kernels"
  [decode]="(e) decoding at 8K-32K: zoo bench --decode, where it takes --device cuda")

CUDA_TESTS="tests/test_flex.py tests/variants/test_flex_blocks.py tests/variants/test_dsa_triton.py
  tests/variants/test_fla_backend.py tests/variants/test_fla_nsa.py -k test_cuda_"
LENGTHS="8192 16384 32768"
EXACT="longformer bigbird sparse_transformer xformers"
BENCH="--device cuda --dtype bf16 --mode fwd+bwd --repeats 3 --warmup 1 --no_progress --lengths $LENGTHS
  --variant_params xformers.window=512"
# the content-chosen variants (causal only; 12 heads, no GQA: nsa's selected branch never reaches fla's kernel)
CONTENT="--variants moba nsa dsa sdpa --causal --device cuda --dtype bf16 --mode fwd+bwd --repeats 2 --warmup 1
  --no_progress --lengths $LENGTHS"
# the recurrent variants (causal only): on fla's kernels (CUDA bf16: the default when fla is installed) and on the
# zoo's chunked kernels (ATTENTION_ZOO_FLA=0), dense SDPA once as the yardstick
RECURRENT_VARIANTS="deltanet gated_deltanet gla"
RECURRENT="--causal --device cuda --dtype bf16 --mode fwd+bwd --repeats 2 --warmup 1 --no_progress --lengths $LENGTHS
  --max_seconds 15"
DECODE="--decode --device cuda --variants sdpa longformer moba nsa dsa --lengths $LENGTHS --no_progress"
export CUDA_TESTS EXACT BENCH CONTENT RECURRENT_VARIANTS RECURRENT DECODE
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
  if grep -q "^SKIPPED" "$DIR/logs/$step.log"; then echo "tests were skipped: no CUDA (or no fla, no triton)?"; return 1; fi
  return $rc
}
# shellcheck disable=SC2086  # a word list
step_cuda_tests() { cuda_tests cuda-tests $CUDA_TESTS; }

zoo_bench() {  # the installed project's `zoo bench`; a rehearsal checks the arguments only
  local dry=()
  [ "$MODE" = rehearse ] && dry=(--dry_run)
  "$PY" scripts/gpu_tools.py zoo bench "$@" "${dry[@]}"
}
# shellcheck disable=SC2086  # $EXACT, $BENCH, $CONTENT, $RECURRENT and $DECODE are word lists
step_bench_patterns() {
  local rc=0 out=$DIR/bench-patterns
  zoo_bench --variants $EXACT sdpa $BENCH --backend flex --max_seconds 30 --output_dir "$out/flex" || rc=1
  zoo_bench --variants $EXACT sdpa $BENCH --backend chunked --max_seconds 15 --output_dir "$out/chunked" || rc=1
  return $rc
}
# shellcheck disable=SC2086
step_bench_content() {
  local rc=0 out=$DIR/bench-content
  zoo_bench $CONTENT --backend flex --max_seconds 30 --output_dir "$out/flex-triton" || rc=1
  ATTENTION_ZOO_TRITON=0 zoo_bench $CONTENT --backend chunked --max_seconds 12 --output_dir "$out/chunked" || rc=1
  return $rc
}
# shellcheck disable=SC2086
step_bench_recurrent() {
  local rc=0 out=$DIR/bench-recurrent
  zoo_bench --variants $RECURRENT_VARIANTS sdpa $RECURRENT --output_dir "$out/fla" || rc=1
  ATTENTION_ZOO_FLA=0 zoo_bench --variants $RECURRENT_VARIANTS $RECURRENT --output_dir "$out/zoo" || rc=1
  return $rc
}
# shellcheck disable=SC2086
step_decode() {
  if "$PY" scripts/gpu_tools.py zoo bench $DECODE --output_dir "$DIR/decode" --dry_run; then
    zoo_bench $DECODE --output_dir "$DIR/decode"
    return
  fi
  echo "not measured: zoo bench --decode refuses --device cuda (it measures on the CPU only); decoding figures come"
  echo "from CPU runs (results/bench/decode_sparse/)"
}
export -f step_install step_env cuda_tests step_cuda_tests zoo_bench step_bench_patterns step_bench_content \
  step_bench_recurrent step_decode

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
  local name=$1 log=$DIR/logs/$1.log runs
  case $name in
    install) grep -E "^(installing|gpu_tools|no |pip on)" "$log" ;;
    env) cat "$DIR/env/env.md" 2>/dev/null ;;
    cuda-tests)
      if [ "$MODE" = rehearse ]; then grep -E "tests? collected|error" "$log"; return; fi
      echo "| test | result |"
      echo "|---|---|"
      # pytest -v writes each test's id when it starts and its outcome when it ends: a cut-off test shows as such
      awk '/^tests\/[^ ]*::/ { split($1, id, "::"); outcome = $2 ~ /^[A-Z]+$/ ? $2 : "unfinished (the step ended)"
                               print "| " id[2] " | " outcome " |" }' "$log"
      grep -E "^=+ .*(passed|failed|error).* =+$" "$log" | tail -n 1
      ;;
    decode) grep -E "^(not measured|from CPU|zoo bench)" "$log" ;;
    bench-*)
      if [ "$MODE" = rehearse ]; then grep "^zoo bench --dry_run" "$log"; return; fi
      case $name in bench-patterns) runs="flex chunked" ;; bench-content) runs="flex-triton chunked" ;;
        *) runs="fla zoo" ;; esac
      for run in $runs; do
        echo "**$run** ($name/$run/bench.md):"
        echo
        section "$DIR/$name/$run/bench.md" "Time (s)" "Peak memory" "Against sdpa" "Errors" || echo "(no bench.md)"
        echo
      done ;;
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
