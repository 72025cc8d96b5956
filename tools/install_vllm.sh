#!/usr/bin/env bash
# Installs what the tests of kvoffload.vllm import: vLLM 0.33.0's Python sources (its
# compiled CUDA ops are deleted: nothing here needs them) into third_party/vllm/site and
# the pins of third_party/vllm/requirements.txt into third_party/vllm/pins, both --no-deps
# so the machine's torch stays. Writes third_party/vllm/INSTALLED last; does nothing when
# it is current. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/../third_party/vllm"

python="${PYTHON_BIN_PATH:-python3}"
vllm=vllm==0.33.0
want="$vllm $("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])') $(sha1sum requirements.txt | cut -c1-12)"
if [ "$(cat INSTALLED 2>/dev/null)" = "$want" ]; then
  exit 0
fi
rm -rf INSTALLED site pins
"$python" -m pip install -q --no-deps --no-compile --target site "$vllm"
find site -type f \( -name '*.so' -o -name '*.h' -o -name '*.hpp' -o -name '*.cuh' -o -name '*.cu' \
  -o -name '*.cpp' -o -name '*.inl' \) -delete
rm -f site/vllm/vllm-rs
"$python" -m pip install -q --no-deps --no-compile --target pins -r requirements.txt
echo "$want" > INSTALLED
echo "install_vllm.sh: $vllm in third_party/vllm ($(du -sh site pins | cut -f1 | paste -sd+))"
