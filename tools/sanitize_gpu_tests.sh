#!/usr/bin/env bash
# Runs GPU test files under compute-sanitizer, once per tool; on a GPU host, inside
# gpu_bundle/ (tools/stage_gpu_bundle.sh) or with PYTHONPATH set to the package.
#   tools/sanitize_gpu_tests.sh [--tools=memcheck,racecheck,synccheck] [test file ...]
# Default files: every tests/*_gpu_test.py but meter_gpu_test.py. The sanitizer slows every
# kernel and copy many times over, so the tests' repetition counts shrink
# (KVOFFLOAD_TEST_SCALE, default here 0.01); every test still runs. Exits non-zero if any
# tool reports an error or any test fails. Left out: the tests that run the model loop
# (meter_gpu_test.py, the calibration test), whose cuBLAS and cuDNN kernels racecheck
# reports and whose windows the slowed steps outgrow; and the test that provokes a CUDA
# error on purpose (cudaHostRegister twice), which memcheck would count as 2 errors.
set -uo pipefail
cd "$(dirname "$0")/.."
export KVOFFLOAD_TEST_SCALE="${KVOFFLOAD_TEST_SCALE:-0.01}"
tools=(memcheck racecheck synccheck)
if [[ $# -gt 0 && $1 == --tools=* ]]; then
  IFS=, read -r -a tools <<<"${1#--tools=}"
  shift
fi
files=("$@")
if [[ ${#files[@]} -eq 0 ]]; then
  for f in tests/*_gpu_test.py; do
    [[ $f == tests/meter_gpu_test.py ]] || files+=("$f")
  done
fi
# Each tool's whole output also goes to $SANITIZE_LOG_DIR/<tool>.log (default /tmp), so a
# run cut short by a time limit keeps what it printed.
logs="${SANITIZE_LOG_DIR:-/tmp}"
mkdir -p "$logs"
status=0
for tool in "${tools[@]}"; do
  echo "== compute-sanitizer --tool $tool: ${files[*]}"
  compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
    python3 -m pytest -q -rfE -p no:cacheprovider "${files[@]}" \
    -k "not test_calibration_is_measured_on_its_device_once_cached_and_keyed and not test_registering_a_piece_twice_is_a_named_cuda_error" \
    2>&1 | tee "$logs/$tool.log" | tail -n 25
  rc=${PIPESTATUS[0]}
  echo "== $tool: exit $rc"
  [[ $rc -eq 0 ]] || status=1
done
exit $status
