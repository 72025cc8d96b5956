#ifndef KVOFFLOAD_CC_CUDA_CUDA_CHECK_H_
#define KVOFFLOAD_CC_CUDA_CUDA_CHECK_H_

// CheckCuda: every CUDA runtime status checked, a failure thrown as CudaError.

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "cc/cuda/cuda_error.h"

namespace kvoffload {

// Throws CudaError for any status but cudaSuccess.
inline void CheckCuda(cudaError_t status, const char* call, int64_t copy_index = -1) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // reported here, so no later cudaGetLastError() reports it again
    throw CudaError(call, cudaGetErrorName(status), status, copy_index,
                    cudaGetErrorString(status));
  }
}

// Throws NoCudaDeviceError when there is no GPU or no driver.
inline void RequireCudaDevice() {
  static std::atomic<bool> found{false};
  if (found.load(std::memory_order_relaxed)) return;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver ||
      (status == cudaSuccess && count == 0)) {
    const cudaError_t reported = status == cudaSuccess ? cudaErrorNoDevice : status;
    throw NoCudaDeviceError("cudaGetDeviceCount", cudaGetErrorName(reported), reported, -1,
                            "no CUDA device: this machine has no usable GPU or driver");
  }
  CheckCuda(status, "cudaGetDeviceCount");
  found.store(true, std::memory_order_relaxed);
}

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_CUDA_CUDA_CHECK_H_
