#!/usr/bin/env bash
# Sourced on a GPU host without Bazel, in the repository root, after tools/stage_gpu_bundle.sh
# and tools/stage_vllm_bundle.sh ran here: installs the wheel, unpacks vLLM's light bundle
# into gpu_bundle/ and sets the environment its tests and benchmarks read. Then, from
# gpu_bundle/: python3 -m pytest -q tests; python3 bench/vllm_worker.py --out=...
set -e
python3 -m pip install -q --no-deps --target /tmp/site gpu_bundle/kvoffload-*-cp312-abi3-*.whl
tar -C gpu_bundle -xJf vllm_bundle/vllm_light.tar.xz
cp vllm_bundle/vllm_env.py gpu_bundle/
export PYTHONPATH=/tmp/site:$PWD/gpu_bundle:$PWD/gpu_bundle/bench:$PWD/gpu_bundle/tests
export KVOFFLOAD_VLLM_POOL_IDS=$PWD/vllm_bundle/vllm_pool_ids.npz CUDA_DEVICE_MAX_CONNECTIONS=32
cd gpu_bundle
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
set +e
