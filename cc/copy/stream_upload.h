#ifndef KVOFFLOAD_CC_COPY_STREAM_UPLOAD_H_
#define KVOFFLOAD_CC_COPY_STREAM_UPLOAD_H_

// Host arrays uploaded to device memory in stream order, for the kernels that read them
// (the copy kernel, the page copies).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <initializer_list>
#include <vector>

namespace kvoffload {

// Host arrays copied to device memory in stream order: through a pinned buffer into
// memory from cudaMallocAsync on `stream`, and freed there (cudaFreeAsync) when this is
// destroyed, so after every kernel enqueued on `stream` until then.
class StreamUpload {
 public:
  struct Array {
    const void* data;
    size_t bytes;
  };
  // The arrays one after another, each at a 16-byte boundary. Throws CudaError.
  StreamUpload(std::initializer_list<Array> arrays, cudaStream_t stream);
  ~StreamUpload();
  StreamUpload(const StreamUpload&) = delete;
  StreamUpload& operator=(const StreamUpload&) = delete;

  // Array i in device memory.
  template <typename T>
  const T* array(size_t i) const {
    return reinterpret_cast<const T*>(static_cast<const char*>(device_) + offsets_[i]);
  }

 private:
  cudaStream_t stream_;
  void* device_ = nullptr;
  std::vector<size_t> offsets_;
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_STREAM_UPLOAD_H_
