#!/usr/bin/env bash
# Runs the whole GPU test suite under compute-sanitizer, once per tool; on a GPU host,
# inside gpu_bundle/ (tools/stage_gpu_bundle.sh) or with PYTHONPATH set to the package.
#   tools/sanitize_gpu_tests.sh [tool ...]     # default: memcheck racecheck synccheck
# The sanitizer slows every kernel and copy many times over, so the tests' repetition
# counts shrink (KVOFFLOAD_TEST_SCALE, default here 0.01); every test still runs.
# Exits non-zero if any tool reports an error or any test fails. Left out: the calibration
# test, which times copies beside a model loop (torch's cuBLAS and cuDNN kernels): the
# sanitizer slows the loop's steps past any copy window (WindowTooShort), and racecheck
# reports those libraries' own kernels; and the test that provokes a CUDA error on
# purpose (cudaHostRegister twice), which memcheck would count as 2 errors.
set -uo pipefail
cd "$(dirname "$0")/.."
export KVOFFLOAD_TEST_SCALE="${KVOFFLOAD_TEST_SCALE:-0.01}"
status=0
tools=("$@")
[[ ${#tools[@]} -gt 0 ]] || tools=(memcheck racecheck synccheck)
for tool in "${tools[@]}"; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
    python3 -m pytest -q -rfE -p no:cacheprovider tests/*_gpu_test.py \
    -k "not test_calibration_is_measured_on_its_device_once_cached_and_keyed and not test_registering_a_piece_twice_is_a_named_cuda_error" \
    2>&1 | tail -n 25
  rc=${PIPESTATUS[0]}
  echo "== $tool: exit $rc"
  [[ $rc -eq 0 ]] || status=1
done
exit $status
