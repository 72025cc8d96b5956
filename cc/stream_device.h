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

// Makes `device` current, with its primary context; restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    CheckCuda(cudaGetDevice(&previous_), "cudaGetDevice");
    CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (device_ != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  int device() const { return device_; }

 private:
  int previous_ = 0;
  int device_ = 0;
};

// The stream's device made current, which the driver's batch call and kernel launches
// need on this thread.
class StreamDeviceGuard : public DeviceGuard {
 public:
  explicit StreamDeviceGuard(cudaStream_t stream) : DeviceGuard(StreamDevice(stream)) {}
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_STREAM_DEVICE_H_
