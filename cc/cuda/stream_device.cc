#include "cc/cuda/stream_device.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <stdexcept>
#include <string>

#include "cc/cuda/cuda_check.h"
#include "cc/cuda/driver_symbol.h"

namespace kvoffload {
namespace {

bool PrimaryContextActive(int device) {
  static const auto get_state = reinterpret_cast<PFN_cuDevicePrimaryCtxGetState_v7000>(
      ResolveDriverSymbol("cuDevicePrimaryCtxGetState", 7000));
  unsigned int flags = 0;
  int active = 0;
  // Without the driver's answer, restore as the runtime would.
  return get_state == nullptr || get_state(device, &flags, &active) != CUDA_SUCCESS || active != 0;
}

}  // namespace

int StreamDevice(cudaStream_t stream) {
  RequireNotCapturing(stream);
  int device = 0;
  CheckCuda(cudaStreamGetDevice(stream, &device), "cudaStreamGetDevice");
  return device;
}

void RequireNotCapturing(cudaStream_t stream, const char* name) {
  RequireCudaDevice();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t asked = cudaStreamIsCapturing(stream, &status);
  if (asked == cudaErrorStreamCaptureImplicit) {
    // The legacy stream, while a blocking stream of its device captures: it would join.
    cudaGetLastError();
    status = cudaStreamCaptureStatusActive;
  } else {
    CheckCuda(asked, "cudaStreamIsCapturing");
  }
  if (status != cudaStreamCaptureStatusNone) {
    // The legacy stream answers for the captures of the streams that synchronize with it
    // (blocking streams), other threads' too; not for PyTorch's, which are non-blocking.
    const bool legacy = stream == nullptr || stream == cudaStreamLegacy;
    throw std::invalid_argument(
        std::string(name) + ": is capturing a CUDA graph" +
        (legacy ? " (the legacy default stream, while a capture is under way on this device: "
                  "submit from a stream of your own)"
                : "") +
        (status == cudaStreamCaptureStatusInvalidated ? " (the capture is invalidated)" : "") +
        "; kvoffload's copies are not recorded into graphs: submit them outside the capture");
  }
}

DeviceGuard::DeviceGuard(int device) : device_(device) {
  CheckCuda(cudaGetDevice(&previous_), "cudaGetDevice");
  restore_ = previous_ != device_ && PrimaryContextActive(previous_);
  CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  if (restore_) cudaSetDevice(previous_);
}

}  // namespace kvoffload
