#!/usr/bin/env bash
# Stages gpu_bundle/ for a GPU host that has Python 3.12+ but no Bazel: the cp312-abi3
# wheel, the tests and the benchmarks. The tests there import the installed wheel.
#   tools/stage_gpu_bundle.sh                                              # here
#   python3 -m pip install --no-deps --target /tmp/site gpu_bundle/kvoffload-*.whl   # there
#   cd gpu_bundle && PYTHONPATH=/tmp/site python3 -m pytest -q tests
# PYTHON312 names the Python 3.12+ to build for; default: pyenv's 3.12.1.
set -euo pipefail
cd "$(dirname "$0")/.."

python312="${PYTHON312:-$(pyenv prefix 3.12.1 2>/dev/null)/bin/python3}"
if ! "$python312" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
  echo "stage_gpu_bundle.sh: set PYTHON312 to a Python 3.12+ interpreter" >&2
  exit 1
fi
# What checking the wheel's contents needs (not torch: the GPU host runs the suite
# against the installed wheel).
"$python312" -m pip install -q $(grep -E '^(pytest|auditwheel)==' requirements.txt)

abi3=(--config=abi3 --repo_env=PYTHON_BIN_PATH="$python312")
bazel test "${abi3[@]}" //tests:wheel_test --test_arg=-k --test_arg='not installed'
wheel="$(bazel cquery "${abi3[@]}" //:wheel --output=starlark \
  --starlark:expr='target.files.to_list()[0].path' 2>/dev/null)"
case "$wheel" in
  *-cp312-abi3-*.whl) ;;
  *) echo "stage_gpu_bundle.sh: expected a cp312-abi3 wheel, got '$wheel'" >&2; exit 1 ;;
esac

rm -rf gpu_bundle
mkdir -p gpu_bundle/tests gpu_bundle/bench/results gpu_bundle/tools
install -m 644 "$wheel" gpu_bundle/
cp tests/*.py tests/*/*.py gpu_bundle/tests/  # flat: each test imports its helpers by name
cp tools/check_targets.py gpu_bundle/tests/  # what check_targets_test imports
cp bench/vllm_caches.py gpu_bundle/tests/     # what the tests on vLLM's own caches import
# wheel_test needs Bazel (the bundle's suite runs on the wheel itself); vllm_engine_test
# runs vLLM's CPU build from setup.sh's virtual environment, a CPU machine's test.
rm gpu_bundle/tests/wheel_test.py gpu_bundle/tests/vllm_engine_test.py gpu_bundle/tests/vllm_engine_run.py
cp bench/*.py gpu_bundle/bench/
cp tools/sanitize_gpu_tests.sh gpu_bundle/tools/
echo "staged $(du -sh gpu_bundle | cut -f1) in gpu_bundle/: $(basename "$wheel"), tests, bench"
