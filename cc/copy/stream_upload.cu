#include "cc/copy/stream_upload.h"

#include <cstring>

#include "cc/copy/pinned_buffers.h"
#include "cc/cuda/cuda_check.h"

namespace kvoffload {

StreamUpload::StreamUpload(std::initializer_list<Array> arrays, cudaStream_t stream)
    : stream_(stream) {
  size_t bytes = 0;
  for (const Array& p : arrays) {
    offsets_.push_back(bytes);
    bytes += (p.bytes + 15) / 16 * 16;
  }
  if (bytes == 0) return;
  PinnedBuffers& pinned = PinnedBuffers::Instance();
  char* host = static_cast<char*>(pinned.Acquire(bytes));
  size_t i = 0;
  for (const Array& p : arrays) std::memcpy(host + offsets_[i++], p.data, p.bytes);
  cudaError_t status = cudaMallocAsync(&device_, bytes, stream);
  if (status == cudaSuccess) {
    status = cudaMemcpyAsync(device_, host, bytes, cudaMemcpyHostToDevice, stream);
  }
  try {
    pinned.Release(host, stream);
  } catch (...) {
    if (device_ != nullptr) cudaFreeAsync(device_, stream);
    throw;
  }
  if (status != cudaSuccess && device_ != nullptr) cudaFreeAsync(device_, stream);
  CheckCuda(status, "upload to the device (cudaMallocAsync, cudaMemcpyAsync)");
}

StreamUpload::~StreamUpload() {
  if (device_ != nullptr) cudaFreeAsync(device_, stream_);
}

}  // namespace kvoffload
