#include "cc/pinned_pool.h"

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#include "cc/cuda_check.h"

namespace kvoffload {
namespace {

// CheckCuda, after clearing the error so that no later cudaGetLastError() reports it.
void Check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) cudaGetLastError();
  CheckCuda(status, call);
}

void RequireRange(int64_t address, int64_t bytes) {
  if (address <= 0) throw std::invalid_argument("address: must be > 0");
  if (bytes <= 0) throw std::invalid_argument("bytes: must be > 0, got " + std::to_string(bytes));
}

// Makes `device` current and this thread's capture mode relaxed; restores both.
class PoolCallScope {
 public:
  explicit PoolCallScope(int device) {
    if (device < 0) throw std::invalid_argument("device: must be >= 0, got " + std::to_string(device));
    RequireCudaDevice();
    Check(cudaThreadExchangeStreamCaptureMode(&mode_), "cudaThreadExchangeStreamCaptureMode");
    const cudaError_t got = cudaGetDevice(&previous_device_);
    const cudaError_t set = got == cudaSuccess ? cudaSetDevice(device) : got;
    if (set != cudaSuccess) {
      cudaThreadExchangeStreamCaptureMode(&mode_);  // undo; the error below is the one to report
      Check(set, got == cudaSuccess ? "cudaSetDevice" : "cudaGetDevice");
    }
  }
  ~PoolCallScope() {
    // Destructors cannot throw; these only restore what the constructor changed.
    cudaSetDevice(previous_device_);
    cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  PoolCallScope(const PoolCallScope&) = delete;
  PoolCallScope& operator=(const PoolCallScope&) = delete;

 private:
  int previous_device_ = 0;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace

void RegisterPoolPiece(int64_t address, int64_t bytes, int device) {
  RequireRange(address, bytes);
  PoolCallScope scope(device);
  Check(cudaHostRegister(reinterpret_cast<void*>(address), bytes,
                         cudaHostRegisterPortable | cudaHostRegisterMapped),
        "cudaHostRegister");
}

void UnregisterPoolPiece(int64_t address, int device) {
  RequireRange(address, 1);
  PoolCallScope scope(device);
  Check(cudaHostUnregister(reinterpret_cast<void*>(address)), "cudaHostUnregister");
}

bool HostRegisterSupported(int device) {
  PoolCallScope scope(device);
  int supported = 0;
  Check(cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterSupported, device),
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
  Check(status, "cudaDeviceGetAttribute(cudaDevAttrHostNumaId)");
  return node;
}

int64_t PoolHostAlloc(int64_t bytes, int device) {
  RequireRange(1, bytes);
  PoolCallScope scope(device);
  void* pointer = nullptr;
  Check(cudaHostAlloc(&pointer, bytes, cudaHostAllocPortable | cudaHostAllocMapped), "cudaHostAlloc");
  return reinterpret_cast<int64_t>(pointer);
}

void PoolFreeHost(int64_t address, int device) {
  RequireRange(address, 1);
  PoolCallScope scope(device);
  Check(cudaFreeHost(reinterpret_cast<void*>(address)), "cudaFreeHost");
}

}  // namespace kvoffload
