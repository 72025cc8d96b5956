#!/usr/bin/env bash
# Stages vllm_bundle/vllm_light.tar.xz for a GPU host without Bazel or network: the vLLM
# modules that kvoffload.vllm's worker, its worker tests and bench/vllm_worker.py import,
# and msgspec as a cp312 wheel (vLLM's only compiled import there), plus vllm_env.py.
# Run tools/install_vllm.sh first. On the host, inside gpu_bundle/ (tools/stage_gpu_bundle.sh):
#   tar xJf vllm_light.tar.xz && cp vllm_env.py .          # both from vllm_bundle/
#   PYTHONPATH=. python3 -m pytest -q tests/vllm_worker_test.py tests/vllm_worker_gpu_test.py
#   PYTHONPATH=. python3 bench/vllm_worker.py --out=bench/results/vllm_worker_h200.json
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON_BIN_PATH:-python3}"
site=third_party/vllm/site
[ -f third_party/vllm/INSTALLED ] || { echo "stage_vllm_bundle.sh: run tools/install_vllm.sh first" >&2; exit 1; }

rm -rf vllm_bundle && mkdir -p vllm_bundle/vllm_light/pins vllm_bundle/wheel
# The vLLM files those imports load, found by importing them here.
KVOFFLOAD_VLLM_DIR="$PWD/third_party/vllm" PYTHONPATH="$PWD/third_party/vllm:$PWD/py" "$python" - "$site" <<'PY' > vllm_bundle/files
import os, sys
import vllm_env  # noqa: F401
import vllm.v1.kv_offload.base, vllm.v1.kv_offload.cpu.common  # noqa: E401
site = os.path.realpath(sys.argv[1])
for m in list(sys.modules.values()):
    f = os.path.realpath(getattr(m, "__file__", None) or "")
    if f.startswith(site + os.sep) and f.endswith(".py"):
        print(os.path.relpath(f, site))
PY
tar -C "$site" -cf - -T vllm_bundle/files | tar -C vllm_bundle/vllm_light -xf - --transform 's,^,site/,'
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 "$(grep '^msgspec==' third_party/vllm/requirements.txt)" -d vllm_bundle/wheel
"$python" -m zipfile -e vllm_bundle/wheel/msgspec-*.whl vllm_bundle/vllm_light/pins
echo "light bundle: vLLM's offloading modules only; no vllm.config" > vllm_bundle/vllm_light/LIGHT
tar -C vllm_bundle -cJf vllm_bundle/vllm_light.tar.xz vllm_light
cp third_party/vllm/vllm_env.py vllm_bundle/
rm -rf vllm_bundle/vllm_light vllm_bundle/wheel vllm_bundle/files
echo "staged $(du -h vllm_bundle/vllm_light.tar.xz | cut -f1) in vllm_bundle/"
