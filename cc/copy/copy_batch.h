#ifndef KVOFFLOAD_CC_COPY_COPY_BATCH_H_
#define KVOFFLOAD_CC_COPY_COPY_BATCH_H_

// A batch of raw copies (source, destination and size arrays) and its validation, which
// every copy method runs before it copies.

#include <cstdint>

namespace kvoffload {

// When a copy may read its source. The values are the driver's CUmemcpySrcAccessOrder.
enum class SrcAccessOrder : uint8_t {
  kStream = 1,         // in stream order, after earlier work on the stream
  kDuringApiCall = 2,  // before the submitting call returns (ephemeral sources)
  kAny = 3,            // at any time, even after the call returns
};

// size[i] bytes from address src[i] to address dst[i], for i < count. Borrowed arrays.
struct CopyBatch {
  const int64_t* src = nullptr;
  const int64_t* dst = nullptr;
  const int64_t* size = nullptr;
  int64_t count = 0;
  // One SrcAccessOrder value per copy; nullptr means kStream for all.
  const uint8_t* order = nullptr;
  // Every copy carries CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE, the driver's hint to
  // overlap it with the SMs' work (a study: the driver may ignore it).
  bool prefer_overlap = false;
};

// Throws std::invalid_argument naming the first offending copy ("sizes[3]: ...").
void ValidateCopyBatch(const CopyBatch& batch);

bool IsSrcAccessOrder(int64_t value);

int64_t TotalBytes(const CopyBatch& batch);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_COPY_BATCH_H_
