#include "cc/pool/host_memory.h"

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#include "cc/cuda/capture_mode.h"
#include "cc/cuda/cuda_check.h"

namespace kvoffload {

void HostRegister(int64_t address, int64_t bytes) {
  if (address == 0) throw std::invalid_argument("address: null pointer");
  if (bytes <= 0) throw std::invalid_argument("bytes: must be > 0, got " + std::to_string(bytes));
  RequireCudaDevice();
  CheckCuda(cudaHostRegister(reinterpret_cast<void*>(address), bytes, cudaHostRegisterDefault),
            "cudaHostRegister");
}

void HostUnregister(int64_t address) {
  RequireCudaDevice();
  const RelaxedCaptureMode relaxed;  // also while another thread captures a graph
  CheckCuda(cudaHostUnregister(reinterpret_cast<void*>(address)), "cudaHostUnregister");
}

bool IsPinnedHost(int64_t address) {
  RequireCudaDevice();
  cudaPointerAttributes attributes;
  CheckCuda(cudaPointerGetAttributes(&attributes, reinterpret_cast<void*>(address)),
            "cudaPointerGetAttributes");
  return attributes.type == cudaMemoryTypeHost;
}

}  // namespace kvoffload
