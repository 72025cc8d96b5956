#ifndef KVOFFLOAD_CC_CUDA_LOAD_KERNEL_H_
#define KVOFFLOAD_CC_CUDA_LOAD_KERNEL_H_

// Kernels loaded into the context when a handler is made, so a first copy does not wait
// behind the device's work.

#include <cuda_runtime_api.h>

#include "cc/cuda/cuda_check.h"

namespace kvoffload {

// Loads `kernel` into the current device's context now. Under lazy module loading
// (CUDA's default) a kernel is loaded at its first launch, and that launch waits for the
// work already on the device. A kernel with no image for this device is left alone: its
// launches report that.
template <typename Kernel>
void LoadKernel(Kernel kernel, const char* what) {
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
  if (status == cudaErrorNoKernelImageForDevice || status == cudaErrorInvalidDeviceFunction) {
    cudaGetLastError();
    return;
  }
  CheckCuda(status, what);
}

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_CUDA_LOAD_KERNEL_H_
