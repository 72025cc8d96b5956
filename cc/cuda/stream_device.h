#ifndef KVOFFLOAD_CC_CUDA_STREAM_DEVICE_H_
#define KVOFFLOAD_CC_CUDA_STREAM_DEVICE_H_

// A stream's device, and the refusal of a capturing stream, which every copy asks first;
// the device guard that makes it current.

#include <cuda_runtime_api.h>

namespace kvoffload {

// The device a stream belongs to (the current device for the legacy stream), once the
// stream is known not to be capturing a graph (RequireNotCapturing): the driver will not
// say during a capture, and every copy asks it first.
int StreamDevice(cudaStream_t stream);

// Throws std::invalid_argument naming `name` where `stream` is capturing a CUDA graph:
// copies queued there would be recorded, not run (and the driver's batch copy is not even
// recorded; the capture reports success without it).
void RequireNotCapturing(cudaStream_t stream, const char* name = "stream");

// Makes `device` current, with its primary context; restores the caller's device, unless
// that device's primary context is inactive: a thread that never chose a device reads
// device 0, and making it current again would start a context there (hundreds of MiB on
// a GPU the process may not use at all).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  int device() const { return device_; }

 private:
  int previous_ = 0;
  int device_ = 0;
  bool restore_ = false;
};

// The stream's device made current, which the driver's batch call and kernel launches
// need on this thread.
class StreamDeviceGuard : public DeviceGuard {
 public:
  explicit StreamDeviceGuard(cudaStream_t stream) : DeviceGuard(StreamDevice(stream)) {}
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_CUDA_STREAM_DEVICE_H_
