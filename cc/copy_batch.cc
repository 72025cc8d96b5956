#include "cc/copy_batch.h"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace kvoffload {

bool IsSrcAccessOrder(int64_t value) {
  return value == static_cast<int64_t>(SrcAccessOrder::kStream) ||
         value == static_cast<int64_t>(SrcAccessOrder::kDuringApiCall) ||
         value == static_cast<int64_t>(SrcAccessOrder::kAny);
}

void ValidateCopyBatch(const CopyBatch& batch) {
  if (batch.count < 0) {
    throw std::invalid_argument("count: must be >= 0, got " + std::to_string(batch.count));
  }
  for (int64_t i = 0; i < batch.count; ++i) {
    const std::string at = "[" + std::to_string(i) + "]";
    if (batch.size[i] <= 0) {
      throw std::invalid_argument("sizes" + at + ": must be > 0, got " +
                                  std::to_string(batch.size[i]));
    }
    if (batch.src[i] == 0) throw std::invalid_argument("src" + at + ": null pointer");
    if (batch.dst[i] == 0) throw std::invalid_argument("dst" + at + ": null pointer");
    // User-space and device addresses are below 2^63; a negative one is a corrupt id.
    if (batch.src[i] < 0) throw std::invalid_argument("src" + at + ": negative address");
    if (batch.dst[i] < 0) throw std::invalid_argument("dst" + at + ": negative address");
    if (batch.size[i] > INT64_MAX - batch.src[i] || batch.size[i] > INT64_MAX - batch.dst[i]) {
      throw std::invalid_argument("sizes" + at + ": " + std::to_string(batch.size[i]) +
                                  " bytes run past the end of the address space");
    }
    if (batch.order != nullptr && !IsSrcAccessOrder(batch.order[i])) {
      throw std::invalid_argument("order" + at + ": " + std::to_string(batch.order[i]) +
                                  " is not a source access order");
    }
  }
}

int64_t TotalBytes(const CopyBatch& batch) {
  int64_t total = 0;
  for (int64_t i = 0; i < batch.count; ++i) total += batch.size[i];
  return total;
}

}  // namespace kvoffload
