#include "cc/copy/pinned_buffers.h"

#include <algorithm>

#include "cc/cuda/cuda_check.h"

namespace kvoffload {

PinnedBuffers& PinnedBuffers::Instance() {
  static PinnedBuffers* instance = new PinnedBuffers();  // never destroyed: no teardown order
  return *instance;
}

void* PinnedBuffers::Acquire(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Buffer& b : buffers_) {
    if (b.in_use || b.bytes < bytes) continue;
    if (b.released != nullptr) {
      const cudaError_t status = cudaEventQuery(b.released);
      if (status == cudaErrorNotReady) continue;
      CheckCuda(status, "cudaEventQuery");
    }
    b.in_use = true;
    return b.data;
  }
  Buffer b;
  b.bytes = std::max<size_t>(size_t{1} << 16, size_t{1} << (64 - __builtin_clzll(bytes - 1)));
  CheckCuda(cudaMallocHost(&b.data, b.bytes), "cudaMallocHost");
  b.in_use = true;
  buffers_.push_back(b);
  return b.data;
}

void PinnedBuffers::Release(void* buffer, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Buffer& b : buffers_) {
    if (b.data != buffer) continue;
    int device = 0;
    CheckCuda(cudaGetDevice(&device), "cudaGetDevice");
    if (b.released != nullptr && b.event_device != device) {
      // Its last use has finished (Acquire saw to that); the event belongs to another GPU.
      CheckCuda(cudaEventDestroy(b.released), "cudaEventDestroy");
      b.released = nullptr;
    }
    if (b.released == nullptr) {
      CheckCuda(cudaEventCreateWithFlags(&b.released, cudaEventDisableTiming), "cudaEventCreate");
      b.event_device = device;
    }
    // A buffer whose release failed stays in use: nothing says when the stream is done.
    CheckCuda(cudaEventRecord(b.released, stream), "cudaEventRecord");
    b.in_use = false;
    return;
  }
}

}  // namespace kvoffload
