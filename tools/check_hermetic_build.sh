#!/usr/bin/env bash
# Fails unless the extension and the CUDA libraries build with the hermetic toolkit:
# @kvoffload_cuda holds the pinned wheels' files (no link out of the build), nvcc comes
# from there, and no compile or link action names a path into /usr/local/cuda,
# $CUDA_PATH or an installed nanobind.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "check_hermetic_build.sh: $*" >&2; exit 1; }

toolkit="$(bazel info output_base 2>/dev/null)/external/kvoffload_cuda"
bazel build //py/kvoffload:_C
grep -q '^CUDA_TOOLKIT = "hermetic"$' "$toolkit/defs.bzl" ||
  fail "@kvoffload_cuda is a local toolkit ($(grep CUDA_TOOLKIT "$toolkit/defs.bzl"))"
links="$(find "$toolkit/cuda" -type l | head -n 3)"
[[ -z "$links" ]] || fail "@kvoffload_cuda links outside the build: $links"

actions="$(bazel aquery --output=text \
  'mnemonic("NvccCompile|CppCompile|CppLink", deps(//py/kvoffload:_C))' 2>/dev/null)"
nvcc_actions=$(grep -c '^action .Compiling CUDA' <<<"$actions" || true)
[[ $nvcc_actions -gt 0 ]] || fail "aquery found no CUDA compile actions"
grep -q 'external/kvoffload_cuda/cuda/bin/nvcc' <<<"$actions" || fail "nvcc is not @kvoffload_cuda's"
for system in /usr/local/cuda ${CUDA_PATH:+"$CUDA_PATH"} site-packages/nanobind; do
  if grep -n -- "$system" <<<"$actions" | head -n 3; then
    fail "an action names $system"
  fi
done
echo "hermetic: $nvcc_actions CUDA compiles, and no compile or link reads a system CUDA or nanobind"
