#!/usr/bin/env bash
# Download into .whl/ (ignored by git) the wheels the GPU machine lacks for scripts/gpu_check.sh. That machine (one
# H200, no network) has its own python3 3.12 with torch 2.11.0+cu130, transformers 5.17.0, accelerate 1.15,
# triton 3.6, pyarrow, pandas, fsspec, xxhash, requests, ... (scripts/gpu_tools.py keeps the list) and lacks:
# transformers at the version zoo's patches are verified on, datasets, evaluate, dill, multiprocess, xformers,
# flash-linear-attention / fla-core, and the project itself. Versions are the ones .venv's tests pass with.
# Run here, where PyPI is reachable; carry .whl with the tree (the device tool's `carry`), 64 MiB in all.
#
#   bash scripts/gpu_wheels.sh        # writes .whl/*.whl and .whl/MANIFEST.txt, prints the list and the total
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WHL=.whl
FLA=0.6.0  # flash-linear-attention and fla-core go together; kept out of CPU environments, so not in .venv

venv_version() { "$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }
verified=$(grep -rh '^VERIFIED_ON = "' zoo | head -n 1 | sed 's/^VERIFIED_ON = "\([0-9.]*\)".*/\1/')
transformers=$(venv_version transformers)
case $transformers in
  "$verified" | "$verified".*) ;;
  *) echo "gpu_wheels: .venv has transformers $transformers; carrying the newest $verified.x, where zoo's patches are verified"
     transformers="$verified.*" ;;
esac

rm -rf "$WHL"
mkdir -p "$WHL"
download() {
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d "$WHL" "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
download "transformers==$transformers" "datasets==$(venv_version datasets)" "evaluate==$(venv_version evaluate)" \
  "dill==$(venv_version dill)" "multiprocess==$(venv_version multiprocess)" "xformers==$(venv_version xformers)" \
  "fla-core==$FLA" "flash-linear-attention==$FLA"
rm -rf build  # setuptools would ship files left in build/lib by an earlier build (a module moved since)
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation . -w "$WHL"

tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null |
  awk '{ s += $1 } END { print s + 0 }')
"$PY" scripts/gpu_tools.py wheels "$WHL" --manifest "$WHL/MANIFEST.txt" --tree-bytes "$tree_bytes" \
  --why "transformers=zoo's patches are verified on $verified (the machine has 5.17.0)" \
  --why "datasets=zoo's data loaders (the recipes) import it; none there; the check's steps do not" \
  --why "evaluate=zoo's metrics (the recipes) import it; none there; the check's steps do not" \
  --why "dill=needed by datasets and evaluate; none there" \
  --why "multiprocess=needed by datasets and evaluate; none there" \
  --why "xformers=the xformers variant's kernel on CUDA; none there; PyPI's only Linux build of it" \
  --why "fla-core=fla's triton kernels (pure Python: any torch >= 2.7 with triton >= 3.3); none there" \
  --why "flash-linear-attention=fla's layers over fla-core; none there" \
  --why "attention-zoo=the project: the tree alone lacks zoo.variants (mapped from variants/) and its entry points"
cat <<'EOF'
Not on PyPI: an xformers build for torch 2.11 + CUDA 13 (PyPI holds one Linux wheel per version; the one above says
what it was built for). Its C++/CUDA extension will not load there (it links libcudart.so.12); xformers 0.0.35's
attention needs none of it: its source sends the fa2 and cutlass operators to PyTorch's own kernels (aten), and the
check's env log (python3 -m xformers.info) says which operators are available there.
flash-linear-attention and fla-core have no per-torch/CUDA builds to match: they are pure Python over triton.
EOF
