#ifndef KVOFFLOAD_CC_MEMORY_MEMORY_REACH_H_
#define KVOFFLOAD_CC_MEMORY_MEMORY_REACH_H_

// Whether a kernel on a device may touch every copy's ends, asked of the driver once per
// allocation; the copy kernel, the staged copy and the page copies check it.

#include <cstdint>

#include "cc/memory/memory_map.h"
#include "cc/memory/reach_check.h"

namespace kvoffload {

// Throws std::invalid_argument naming `side`[i] for the first copy whose first or last
// byte is not memory a kernel on `device` can reach as `reach` asks: pageable host
// memory (a kernel would fault on it), another GPU's memory, or the wrong kind. Asks the
// driver once per allocation (or per host page where it gives no range), not per copy.
void RequireReachable(const int64_t* addresses, const int64_t* sizes, int64_t count,
                      int device, Reach reach, const char* side);

// What cuPointerGetAttributes says of `address` (a MemoryMap's query). Unknown
// addresses are not an error: they come back as MemoryKind::kUnknown.
PointerAttributes AskDriver(int64_t address);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_MEMORY_MEMORY_REACH_H_
