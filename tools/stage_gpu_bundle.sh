#!/usr/bin/env bash
# Stages gpu_bundle/ for a GPU host that has Python 3.12+ but no Bazel: the package
# with its stable-ABI extension (_C.abi3.so), the tests and the benchmarks.
#   tools/stage_gpu_bundle.sh            # here
#   cd gpu_bundle && python3 -m pytest -q tests && python3 bench/batch_copy.py   # there
# PYTHON312 names the Python 3.12+ to build for; default: pyenv's 3.12.1.
set -euo pipefail
cd "$(dirname "$0")/.."

python312="${PYTHON312:-$(pyenv prefix 3.12.1 2>/dev/null)/bin/python3}"
if ! "$python312" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
  echo "stage_gpu_bundle.sh: set PYTHON312 to a Python 3.12+ interpreter" >&2
  exit 1
fi
"$python312" -m pip install -q "$(grep '^nanobind==' requirements.txt)"

bazel build --config=abi3 --repo_env=PYTHON_BIN_PATH="$python312" //py/kvoffload:_C

rm -rf gpu_bundle
mkdir -p gpu_bundle/tests gpu_bundle/bench
cp -r py/kvoffload gpu_bundle/kvoffload
rm -f gpu_bundle/kvoffload/BUILD.bazel gpu_bundle/kvoffload/*.cc
cp bazel-bin/py/kvoffload/_C.abi3.so gpu_bundle/kvoffload/
cp tests/*.py gpu_bundle/tests/
cp bench/*.py gpu_bundle/bench/
mkdir -p gpu_bundle/tools && cp tools/sanitize_gpu_tests.sh gpu_bundle/tools/
mkdir -p gpu_bundle/bench/results
echo "staged $(du -sh gpu_bundle | cut -f1) in gpu_bundle/"
