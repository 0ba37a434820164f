#!/usr/bin/env bash
# The compatibility job: one venv per transformers release (torch 2.13 CPU), the project installed in it, then the
# patch canaries, the generate tests, the no-silent-answer tests and the contract suite for a few variants; one line
# per release at the end. A release below the supported floor must be refused at `import zoo` (the refusal is shown).
#
# Usage: scripts/compat_check.sh [VERSION ...]
#   default: the release just below the floor, the floor and the newest tested release (read from zoo/compat.py).
# Environment: COMPAT_DIR (default .compat: one venv per release, kept for re-runs), PYTHON (default python3).
#
# A release whose requirements this registry lacks is installed with --no-deps over the floor's dependencies, and the
# feature that needs the missing package is switched off (each such step is printed, with `pip check`'s line):
# transformers 5.25 requires kernels>=0.19.1, the newest here is 0.17.2, so 5.25 runs without `kernels` and with
# USE_HUB_KERNELS=0.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
COMPAT_DIR=${COMPAT_DIR:-.compat}
read -r BELOW FLOOR NEWEST < <("$PYTHON" - <<'EOF'
import ast, pathlib
tree = ast.parse(pathlib.Path("zoo/compat.py").read_text())
values = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
          for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
print(values["BELOW_FLOOR_CHECKED"], values["FLOOR"], values["NEWEST_TESTED"])
EOF
)
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=("$BELOW" "$FLOOR" "$NEWEST")
# Each entry: what it checks (the contract suite only for the variants named in CONTRACT_VARIANTS).
TESTS=(tests/test_patches.py tests/test_generate.py tests/test_compat.py tests/test_contract.py)
CONTRACT_VARIANTS="sdpa or longformer or deltanet or budget"
declare -a SUMMARY

release() {  # 5.24 -> 5.24.0: one spelling for every version named
  "$PYTHON" -c "import sys; p = sys.argv[1].split('.'); print('.'.join(p + ['0'] * (3 - len(p))))" "$1"
}
older_than_floor() {  # $1 < FLOOR, by release numbers
  "$PYTHON" -c "import sys; v=lambda s: tuple(int(p) for p in s.split('.')[:2]); sys.exit(0 if v('$1') < v('$FLOOR') else 1)"
}

for requested in "${VERSIONS[@]}"; do
  version=$(release "$requested")
  venv="$COMPAT_DIR/venv-$version"
  log="$COMPAT_DIR/$version.log"
  mkdir -p "$COMPAT_DIR"
  echo "=== transformers $version: building $venv"
  start=$(date +%s)
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  pip="$venv/bin/python -m pip"
  env_vars=(HF_HUB_OFFLINE=1)
  # torch first (the CPU build on disk), then the project with the floor's dependencies, then the release itself.
  if ! { $pip install -q "torch==2.13.0" \
         && PYTHONWARNINGS="ignore:Editable installation:UserWarning" $pip install -q -e ".[dev]" \
                "transformers==$(release "$FLOOR")"; } >"$log" 2>&1; then
    SUMMARY+=("transformers $version: FAILED to install the project (see $log)"); continue
  fi
  if [[ "$version" != "$(release "$FLOOR")" ]]; then
    if older_than_floor "$version"; then
      echo "    below the floor the project declares: installing transformers==$version with --no-deps"
      $pip install -q --no-deps "transformers==$version" >>"$log" 2>&1
    elif ! $pip install -q "transformers==$version" >>"$log" 2>&1; then
      echo "    transformers==$version cannot be installed with its requirements here: $(grep -m1 'No matching' "$log")"
      echo "    installing it with --no-deps over the floor's dependencies"
      $pip install -q --no-deps "transformers==$version" >>"$log" 2>&1
    fi || { SUMMARY+=("transformers $version: FAILED to install (see $log)"); continue; }
  fi
  missing=$($pip check 2>/dev/null | grep -i "^transformers" || true)
  [ -z "$missing" ] || echo "    pip check: $missing"
  if echo "$missing" | grep -qi "kernels"; then
    echo "    without the kernels package, transformers >= 5.25 refuses every from_pretrained: running with USE_HUB_KERNELS=0"
    env_vars+=(USE_HUB_KERNELS=0)
  fi
  installed=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('transformers'))")
  if older_than_floor "$installed"; then
    # Below the floor: `import zoo` must refuse, naming the version, the range and the fix.
    if refusal=$(env "${env_vars[@]}" "$venv/bin/python" -c "import zoo" 2>&1); then
      SUMMARY+=("transformers $installed: FAILED: import zoo succeeded below the floor $FLOOR")
    else
      echo "    import zoo on transformers $installed (below the floor) says:"
      echo "$refusal" | tail -n 1 | sed 's/^/      /'
      if echo "$refusal" | grep -q "transformers>=$FLOOR"; then
        SUMMARY+=("transformers $installed: refused at import, as it must be (below the floor $FLOOR)")
      else
        SUMMARY+=("transformers $installed: FAILED: import zoo failed without the refusal naming the fix")
      fi
    fi
    continue
  fi
  echo "    running ${TESTS[*]} (contract: $CONTRACT_VARIANTS)"
  if env "${env_vars[@]}" "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" \
       -k "not test_contract or $CONTRACT_VARIANTS" >>"$log" 2>&1; then
    result="passed"
  else
    result="FAILED"
  fi
  counts=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tail -n 1 | tr -d '=' | xargs)
  SUMMARY+=("transformers $installed: $result ($counts; $(( $(date +%s) - start )) s; ${env_vars[*]})")
  [ "$result" = passed ] || tail -n 30 "$log"
done

echo "=== compatibility summary"
status=0
for line in "${SUMMARY[@]}"; do
  echo "  $line"
  [[ "$line" == *FAILED* ]] && status=1
done
exit $status
