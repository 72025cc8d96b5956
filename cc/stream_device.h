#ifndef KVOFFLOAD_CC_STREAM_DEVICE_H_
#define KVOFFLOAD_CC_STREAM_DEVICE_H_

#include <cuda_runtime_api.h>

#include "cc/cuda_check.h"

namespace kvoffload {

// The device a stream belongs to (the current device for the legacy stream).
inline int StreamDevice(cudaStream_t stream) {
  RequireCudaDevice();
  int device = 0;
  CheckCuda(cudaStreamGetDevice(stream, &device), "cudaStreamGetDevice");
  return device;
}

// Makes the stream's device current, with its primary context, which the driver's
// batch call and kernel launches need on this thread; restores the caller's device.
class StreamDeviceGuard {
 public:
  explicit StreamDeviceGuard(cudaStream_t stream) {
    CheckCuda(cudaGetDevice(&previous_), "cudaGetDevice");
    device_ = previous_;
    CheckCuda(cudaStreamGetDevice(stream, &device_), "cudaStreamGetDevice");
    CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
  }
  ~StreamDeviceGuard() {
    if (device_ != previous_) cudaSetDevice(previous_);
  }
  StreamDeviceGuard(const StreamDeviceGuard&) = delete;
  StreamDeviceGuard& operator=(const StreamDeviceGuard&) = delete;

  int device() const { return device_; }

 private:
  int previous_ = 0;
  int device_ = 0;
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_STREAM_DEVICE_H_
