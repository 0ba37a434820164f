set -u
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PIP_NO_INDEX=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
SITE=$(mktemp -d) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE
echo "== fla nsa tests"
timeout 110 python3 -m pytest -p no:cacheprovider -q --tb=short -x tests/variants/test_fla_nsa.py -k test_cuda_ 2>&1 | grep -v "^  warnings\|Warning" | tail -45
for v in moba nsa dsa; do
  echo "== bench $v"
  CUDA_LAUNCH_BLOCKING=1 timeout 45 python3 scripts/gpu_tools.py zoo bench --variants $v --causal --device cuda --dtype bf16 --mode fwd+bwd --lengths 8192 --repeats 1 --warmup 0 --max_seconds 20 --no_progress --output_dir $OUT/b-$v > "$SITE/b-$v.log" 2>&1
  echo "rc=$?"; grep -v "^\s*\^" "$SITE/b-$v.log" | tail -14; grep -A3 "^| variant" $OUT/b-$v/bench.md 2>/dev/null | head -4
done
