#ifndef KVOFFLOAD_CC_MEMORY_REACH_CHECK_H_
#define KVOFFLOAD_CC_MEMORY_REACH_CHECK_H_

// The reach rules (Reach) checked against a MemoryMap, with no driver: memory_reach's
// pure part, tested on CPU.

#include <cstdint>

#include "cc/memory/memory_map.h"

namespace kvoffload {

// What one side of a batch must be for a kernel on a given device to touch it.
enum class Reach {
  kDeviceOrPinnedHost,  // the copy kernel: either end may be either
  kPinnedHost,          // the host side of a staged copy
  kDevice,              // the device side of a staged copy
};

// Throws std::invalid_argument naming `side`[i] for the first copy whose first or last
// byte is, as `map` classifies it, not memory a kernel on `device` can reach as `reach`
// asks: pageable host memory (a kernel would fault on it), another GPU's memory, or the
// wrong kind. The copies must be valid (ValidateCopyBatch).
void RequireReachableIn(MemoryMap& map, const int64_t* addresses, const int64_t* sizes,
                        int64_t count, int device, Reach reach, const char* side);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_MEMORY_REACH_CHECK_H_
