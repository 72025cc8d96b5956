"""vLLM 0.33's own CPUOffloadingWorker, as shipped, on a host without vLLM's compiled ops.

One thing is replaced (vllm_env makes the op-registration modules that
vllm.platforms.cuda imports empty): the op ``_C_cache_ops.swap_blocks_batch`` behind
``vllm._custom_ops.swap_blocks_batch``, by a stand-in that does what vLLM's C++ does:
one cuMemcpyBatchAsync over all the copies, on the current stream, with source access
order ANY when asked (loads) and STREAM otherwise (stores). The rest (descriptor
planning, streams, events, its Triton kernel for small loads) is vLLM's Python.
"""

import numpy as np

import vllm_env  # noqa: F401  (puts vLLM on sys.path)

_library = None  # the stand-in op's registration lives as long as the process


def _swap_blocks_batch(src, dst, sizes, is_src_access_order_any=False):
    import torch

    from kvoffload import _C

    n = src.numel()
    if n == 0:
        return
    order = _C.SrcAccessOrder.ANY if is_src_access_order_any else _C.SrcAccessOrder.STREAM
    _C.batch_copy(np.ascontiguousarray(src.numpy()), np.ascontiguousarray(dst.numpy()),
                  np.ascontiguousarray(sizes.numpy()), torch.cuda.current_stream(), order, n, False)


def install(torch):
    """Registers the stand-in and makes vLLM take its CUDA platform; returns vLLM's
    CPUOffloadingWorker class."""
    global _library
    if _library is None:
        _library = torch.library.Library("_C_cache_ops", "DEF")
        _library.define("swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, "
                        "bool is_src_access_order_any=False) -> ()")
        _library.impl("swap_blocks_batch", _swap_blocks_batch, "CPU")
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform

    platforms._current_platform = CudaPlatform()
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

    return CPUOffloadingWorker
