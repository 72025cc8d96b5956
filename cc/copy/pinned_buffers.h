#ifndef KVOFFLOAD_CC_COPY_PINNED_BUFFERS_H_
#define KVOFFLOAD_CC_COPY_PINNED_BUFFERS_H_

// Page-locked staging for host arrays a stream reads; its one user is stream_upload.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <mutex>
#include <vector>

namespace kvoffload {

// Page-locked host buffers that the host fills and a stream then reads (descriptor
// uploads). A buffer handed back with Release() is reused only once the work the
// stream had queued at that point has finished. Buffers are kept for reuse, so memory
// grows to the peak in use and stays there.
class PinnedBuffers {
 public:
  static PinnedBuffers& Instance();

  // A buffer of at least `bytes`.
  void* Acquire(size_t bytes);
  // `buffer` is free once `stream` has run what is queued on it now. The stream's
  // device must be the current device.
  void Release(void* buffer, cudaStream_t stream);

 private:
  struct Buffer {
    void* data = nullptr;
    size_t bytes = 0;
    cudaEvent_t released = nullptr;
    int event_device = -1;  // an event can be recorded only on streams of its device
    bool in_use = false;
  };
  std::mutex mutex_;
  std::vector<Buffer> buffers_;
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_PINNED_BUFFERS_H_
