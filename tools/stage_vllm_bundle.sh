#!/usr/bin/env bash
# Stages vllm_bundle/vllm_light.tar.xz for a GPU host without Bazel or network: vLLM's
# Python sources, which kvoffload.vllm's worker, its tests and bench/vllm_worker.py (with
# vLLM's own worker) import, msgspec and pyzmq as cp312 wheels (the compiled imports the
# host lacks), plus vllm_env.py.
# Run tools/install_vllm.sh first. On the host, inside gpu_bundle/ (tools/stage_gpu_bundle.sh):
#   tar xJf vllm_light.tar.xz && cp vllm_env.py .          # both from vllm_bundle/
#   export KVOFFLOAD_VLLM_POOL_IDS=$PWD/vllm_pool_ids.npz   # also from vllm_bundle/
#   PYTHONPATH=. python3 -m pytest -q tests/vllm_worker_test.py tests/vllm_worker_gpu_test.py
#   PYTHONPATH=. python3 bench/vllm_worker.py --out=bench/results/vllm_worker_h200.json
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON_BIN_PATH:-python3}"
site=third_party/vllm/site
[ -f third_party/vllm/INSTALLED ] || { echo "stage_vllm_bundle.sh: run tools/install_vllm.sh first" >&2; exit 1; }

rm -rf vllm_bundle && mkdir -p vllm_bundle/vllm_light/pins vllm_bundle/wheel
# vLLM's Python sources, all of them (its worker, bench/vllm_peer.py's peer, imports more
# than its offloading modules), and typing_extensions from the pins.
# Its METADATA too: vLLM reads its own version, and without one it turns Triton off.
(cd "$site" && find vllm -name '*.py' && ls vllm-*.dist-info/METADATA) > vllm_bundle/files
tar -C "$site" -cf - -T vllm_bundle/files | tar -C vllm_bundle/vllm_light -xf - --transform 's,^,site/,'
cp third_party/vllm/pins/typing_extensions.py vllm_bundle/vllm_light/pins/
# vllm.config (which KVOffloadTieringSpec's imports reach) needs pydantic, which the GPU
# image lacks; these are the versions CI's environment tests the tiering spec with.
for pin in "$(grep "^msgspec==" third_party/vllm/requirements.txt)" \
           "$(grep "^pyzmq==" third_party/vllm/requirements.txt)" \
           pydantic==2.13.4 pydantic_core==2.46.4 annotated_types==0.7.0 typing_inspection==0.4.2; do
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
    "$pin" -d vllm_bundle/wheel
done
for wheel in vllm_bundle/wheel/*.whl; do "$python" -m zipfile -e "$wheel" vllm_bundle/vllm_light/pins; done
echo "light bundle: vLLM's Python sources and the pins its worker and vllm.config import" > vllm_bundle/vllm_light/LIGHT
tar -C vllm_bundle -cJf vllm_bundle/vllm_light.tar.xz vllm_light
cp third_party/vllm/vllm_env.py vllm_bundle/
# Block ids from vLLM's BlockPool and CPU manager, which the light bundle cannot import
# (vllm.config's imports): made here, read there through KVOFFLOAD_VLLM_POOL_IDS.
(cd bench && PYTHONPATH="../third_party/vllm" "$python" vllm_caches.py ../vllm_bundle/vllm_pool_ids.npz)
rm -rf vllm_bundle/vllm_light vllm_bundle/wheel vllm_bundle/files
echo "staged $(du -h vllm_bundle/vllm_light.tar.xz | cut -f1) in vllm_bundle/"
