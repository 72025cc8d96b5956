#include "cc/pool/pinned_pool.h"

#include <cuda_runtime_api.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "cc/cuda/cuda_check.h"
#include "cc/cuda/stream_device.h"

namespace kvoffload {
namespace {

void RequireRange(int64_t address, int64_t bytes) {
  if (address <= 0) throw std::invalid_argument("address: must be > 0");
  if (bytes <= 0) throw std::invalid_argument("bytes: must be > 0, got " + std::to_string(bytes));
}

// Makes `device` current (DeviceGuard) and this thread's capture mode relaxed; restores
// both.
class PoolCallScope {
 public:
  explicit PoolCallScope(int device) {
    if (device < 0) {
      throw std::invalid_argument("device: must be >= 0, got " + std::to_string(device));
    }
    RequireCudaDevice();
    CheckCuda(cudaThreadExchangeStreamCaptureMode(&mode_), "cudaThreadExchangeStreamCaptureMode");
    try {
      guard_.emplace(device);
    } catch (...) {
      cudaThreadExchangeStreamCaptureMode(&mode_);  // undo; the error is the one to report
      throw;
    }
  }
  ~PoolCallScope() {
    guard_.reset();
    cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  PoolCallScope(const PoolCallScope&) = delete;
  PoolCallScope& operator=(const PoolCallScope&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  std::optional<DeviceGuard> guard_;
};

}  // namespace

void PoolRegister(int64_t address, int64_t bytes, int device) {
  RequireRange(address, bytes);
  PoolCallScope scope(device);
  CheckCuda(cudaHostRegister(reinterpret_cast<void*>(address), bytes,
                             cudaHostRegisterPortable | cudaHostRegisterMapped),
            "cudaHostRegister");
}

void PoolUnregister(int64_t address, int device) {
  RequireRange(address, 1);
  PoolCallScope scope(device);
  CheckCuda(cudaHostUnregister(reinterpret_cast<void*>(address)), "cudaHostUnregister");
}

bool HostRegisterSupported(int device) {
  PoolCallScope scope(device);
  int supported = 0;
  CheckCuda(cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterSupported, device),
            "cudaDeviceGetAttribute(cudaDevAttrHostRegisterSupported)");
  return supported != 0;
}

int HostNumaNode(int device) {
  PoolCallScope scope(device);
  int node = -1;
  const cudaError_t status = cudaDeviceGetAttribute(&node, cudaDevAttrHostNumaId, device);
  // Drivers older than the attribute reject it: the node is then unknown, not an error.
  if (status == cudaErrorInvalidValue) {
    cudaGetLastError();
    return -1;
  }
  CheckCuda(status, "cudaDeviceGetAttribute(cudaDevAttrHostNumaId)");
  return node;
}

int64_t PoolHostAlloc(int64_t bytes, int device) {
  RequireRange(1, bytes);
  PoolCallScope scope(device);
  void* pointer = nullptr;
  CheckCuda(cudaHostAlloc(&pointer, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
            "cudaHostAlloc");
  return reinterpret_cast<int64_t>(pointer);
}

void PoolFreeHost(int64_t address, int device) {
  RequireRange(address, 1);
  PoolCallScope scope(device);
  CheckCuda(cudaFreeHost(reinterpret_cast<void*>(address)), "cudaFreeHost");
}

}  // namespace kvoffload
