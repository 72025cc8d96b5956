"""The toolchains kvoffload builds with, pinned by version and sha256 in this one place.

The sha256 values are those of the x86_64 Linux wheels on the package registry.
"""

# CUDA 13.0: these wheels unpack together into one toolkit under CUDA_WHEEL_ROOT
# (nvcc, ptxas, fatbinary, nvlink, cicc, the headers, libcudart_static.a).
CUDA_WHEELS = [
    ("nvidia-cuda-nvcc", "13.0.88", "56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03"),
    ("nvidia-cuda-crt", "13.0.88", "2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4"),
    ("nvidia-nvvm", "13.0.88", "c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0"),
    ("nvidia-cuda-runtime", "13.0.96", "7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548"),
    ("nvidia-cuda-cccl", "13.0.85", "e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649"),
]
CUDA_WHEEL_ROOT = "nvidia/cu13"

# GPU architectures: machine code for each, plus PTX of the newest, which later GPUs
# compile when they load it. --repo_env=KVOFFLOAD_CUDA_ARCHS=90 (say) replaces the list.
CUDA_ARCHS = "80,90,100"

NANOBIND_WHEEL = ("nanobind", "3.1.0", "96984dbe8154ffb86e653b1b60aaeed6985c710c5e75ad0279eb87943c66292d")
