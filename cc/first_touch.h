#ifndef KVOFFLOAD_CC_FIRST_TOUCH_H_
#define KVOFFLOAD_CC_FIRST_TOUCH_H_

#include <cstdint>
#include <vector>

namespace kvoffload {

// Faults in every page of [address, address + bytes) for writing, without changing what
// the pages hold, on `threads` threads (at least 1), thread i pinned to cpus[i % size]
// (unpinned if cpus is empty). Throws std::invalid_argument for bad arguments and
// std::system_error when the memory cannot be had (ENOMEM, or EFAULT: a shared file
// whose filesystem is full).
void TouchPages(int64_t address, int64_t bytes, const std::vector<int>& cpus, int threads);

// Asks the kernel to place the pages of [address, address + bytes), when first touched,
// on NUMA node `node` (mbind, MPOL_PREFERRED). Throws std::system_error.
void PreferNumaNode(int64_t address, int64_t bytes, int node);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_FIRST_TOUCH_H_
