#!/usr/bin/env bash
# Runs GPU test files under compute-sanitizer, once per tool; on a GPU host, inside
# gpu_bundle/ (tools/stage_gpu_bundle.sh), whose tests/ is flat.
#   tools/sanitize_gpu_tests.sh [--tools=memcheck,racecheck,synccheck] [--jobs=N] [test file ...]
# Default files: every tests/*_gpu_test.py but meter_gpu_test.py. The sanitizer slows every
# kernel and copy many times over, so the tests' repetition counts shrink
# (KVOFFLOAD_TEST_SCALE, default here 0.01); every test still runs. Exits non-zero if any
# tool reports an error or any test fails. Left out: the tests that run the model loop
# (meter_gpu_test.py, the calibration test), whose cuBLAS and cuDNN kernels racecheck
# reports and whose windows the slowed steps outgrow; and the test that provokes a CUDA
# error on purpose (cudaHostRegister twice), which memcheck would count as 2 errors.
# --jobs=N runs each (tool, file) pair as its own process, N at a time, and prints one
# line per pair. Sanitized processes hold much more GPU memory than plain ones: on one
# H200, 6 jobs with PYTEST_ADDOPTS="-n 2" fit, 10 jobs of "-n 3" ran out of memory.
set -uo pipefail
cd "$(dirname "$0")/.."
export KVOFFLOAD_TEST_SCALE="${KVOFFLOAD_TEST_SCALE:-0.01}"
tools=(memcheck racecheck synccheck)
jobs=1
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --tools=*) IFS=, read -r -a tools <<<"${1#--tools=}" ;;
    --jobs=*) jobs=${1#--jobs=} ;;
    *) echo "sanitize_gpu_tests.sh: unknown flag $1" >&2; exit 2 ;;
  esac
  shift
done
files=("$@")
if [[ ${#files[@]} -eq 0 ]]; then
  for f in tests/*_gpu_test.py; do
    [[ $f == tests/meter_gpu_test.py ]] || files+=("$f")
  done
fi
# Each run's whole output also goes to $SANITIZE_LOG_DIR (default /tmp), so a run cut
# short by a time limit keeps what it printed.
logs="${SANITIZE_LOG_DIR:-/tmp}"
mkdir -p "$logs"

sanitize() {  # tool log file...
  local tool=$1 log=$2
  shift 2
  compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
    python3 -m pytest -q -rfE -p no:cacheprovider "$@" \
    -k "not test_calibration_is_measured_on_its_device_once_cached_and_keyed and not test_registering_a_range_twice_is_a_named_cuda_error" \
    >"$log" 2>&1
}

if [[ $jobs -gt 1 ]]; then
  export -f sanitize
  export logs
  for tool in "${tools[@]}"; do for f in "${files[@]}"; do echo "$tool $f"; done; done |
    xargs -P "$jobs" -L 1 bash -c '
      log="$logs/$0_$(basename "$1" .py).log"
      sanitize "$0" "$log" "$1"; rc=$?
      # A file whose tests all skip (the two-GPU tests on one GPU) makes no CUDA call.
      if grep -q "before first instrumented API call" "$log" && grep -qE "^[0-9]+ skipped in" "$log"; then rc=0; fi
      echo "$0 $1: exit $rc; $(grep -hE "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | sed "s/.*=== //"); $(grep -hE "[0-9]+ (passed|failed|skipped)" "$log" | tail -1)"
      exit $(( rc != 0 ))'
  exit $?
fi
status=0
for tool in "${tools[@]}"; do
  echo "== compute-sanitizer --tool $tool: ${files[*]}"
  sanitize "$tool" "$logs/$tool.log" "${files[@]}"
  rc=$?
  tail -n 25 "$logs/$tool.log"
  echo "== $tool: exit $rc"
  [[ $rc -eq 0 ]] || status=1
done
exit $status
