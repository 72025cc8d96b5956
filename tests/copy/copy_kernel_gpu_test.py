"""kvoffload.kernel_copy on a GPU: odd sizes and alignments, mixed sizes and CTA budgets,
a million copies, every direction, stream order, and the memory it cannot reach."""

import numpy as np
import pytest
import torch

import kvoffload as kv
from gpu_pools import DIRECTIONS, check_refused, check_stream_order, run
from scale import scaled


@pytest.fixture(autouse=True)
def require_gpu():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"


@pytest.mark.parametrize("direction", DIRECTIONS.keys())
@pytest.mark.parametrize("size", [1, 3, 15, 16, 17, 4095, 4096, 4097])
@pytest.mark.parametrize("misalign", [False, True])
def test_kernel_odd_sizes_and_alignments(direction, size, misalign):
    rng = np.random.default_rng(size)
    result = run(kv.kernel_copy, rng, direction, np.full(300, size), 8192, misalign)
    assert result.path == "kernel" and result.bytes == 300 * size


@pytest.mark.parametrize("direction", DIRECTIONS.keys())
@pytest.mark.parametrize("max_ctas", [1, 8, 132])
def test_kernel_mixed_sizes_and_cta_budgets(direction, max_ctas):
    rng = np.random.default_rng(max_ctas)
    sizes = np.concatenate([rng.integers(1, 200_000, 40), rng.integers(1, 5000, 400)])
    run(kv.kernel_copy, rng, direction, sizes, 1 << 18, True, pool_bytes=256 << 20, max_ctas=max_ctas)


@pytest.mark.parametrize("direction", ["load", "store"])
def test_kernel_a_million_copies(direction):
    rng = np.random.default_rng(7)
    run(kv.kernel_copy, rng, direction, np.full(scaled(1 << 20), 16), 16, False, pool_bytes=32 << 20)


def test_kernel_copy_follows_stream_order():
    check_stream_order(lambda *a, **k: kv.kernel_copy(*a, registry=kv.UNCHECKED, **k), 9)


REFUSED = {  # name -> (src memory, dst memory, message)
    "kernel reads pageable": ("pageable", "device",
                              r"src\[0\]: 0x[0-9a-f]+ is neither page-locked host memory nor device memory"),
    "kernel writes pageable": ("device", "pageable", r"dst\[0\]: .* \(pageable host memory\?\)"),
}


@pytest.mark.parametrize("case", REFUSED.keys())
def test_memory_a_kernel_cannot_reach_is_refused_before_copying(case):
    check_refused(kv.kernel_copy, *REFUSED[case])


def test_stream_device_names_the_streams_gpu():
    assert kv.stream_device(torch.cuda.Stream()) == torch.cuda.current_device()
    assert kv.stream_device(None) == torch.cuda.current_device()
