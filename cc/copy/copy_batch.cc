#include "cc/copy/copy_batch.h"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace kvoffload {
namespace {

// Message building stays out of the loop: the loop runs once per copy, at a few ns each.
[[noreturn]] void Reject(const char* array, int64_t i, const std::string& what) {
  throw std::invalid_argument(std::string(array) + "[" + std::to_string(i) + "]: " + what);
}

void RejectCopy(const CopyBatch& batch, int64_t i) {
  if (batch.size[i] <= 0) Reject("sizes", i, "must be > 0, got " + std::to_string(batch.size[i]));
  if (batch.src[i] == 0) Reject("src", i, "null pointer");
  if (batch.dst[i] == 0) Reject("dst", i, "null pointer");
  // User-space and device addresses are below 2^63; a negative one is a corrupt id.
  if (batch.src[i] < 0) Reject("src", i, "negative address");
  if (batch.dst[i] < 0) Reject("dst", i, "negative address");
  if (batch.size[i] > INT64_MAX - batch.src[i] || batch.size[i] > INT64_MAX - batch.dst[i]) {
    Reject("sizes", i,
           std::to_string(batch.size[i]) + " bytes run past the end of the address space");
  }
  Reject("order", i, std::to_string(batch.order[i]) + " is not a source access order");
}

}  // namespace

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
    const int64_t src = batch.src[i], dst = batch.dst[i], size = batch.size[i];
    // Pointers are > 0 and sizes > 0, so the sums below cannot wrap before the test.
    const bool ok = size > 0 && src > 0 && dst > 0 && size <= INT64_MAX - src &&
                    size <= INT64_MAX - dst &&
                    (batch.order == nullptr || IsSrcAccessOrder(batch.order[i]));
    if (!ok) RejectCopy(batch, i);
  }
}

int64_t TotalBytes(const CopyBatch& batch) {
  int64_t total = 0;
  for (int64_t i = 0; i < batch.count; ++i) total += batch.size[i];
  return total;
}

}  // namespace kvoffload
