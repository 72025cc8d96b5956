#ifndef KVOFFLOAD_CC_POOL_FIRST_TOUCH_H_
#define KVOFFLOAD_CC_POOL_FIRST_TOUCH_H_

// A host pool's pages faulted in by threads (madvise populate), with a NUMA preference.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvoffload {

// The most bytes one madvise(MADV_POPULATE_WRITE) call faults in. The call holds the
// process's mmap lock for reading throughout, and an mmap, munmap or thread start
// anywhere in the process waits for the lock (and, once one waits, so does every new
// reader). Small slices bound that wait and were also faster alone
// (docs/studies.md#pinning-the-pool).
constexpr int64_t kPopulateSliceBytes = int64_t{16} << 20;

// Faults in every page of [address, address + bytes) for writing, without changing what
// the pages hold, on `threads` threads (at least 1), thread i pinned to cpus[i % size]
// (unpinned if cpus is empty), each in madvise calls of at most kPopulateSliceBytes.
// Throws std::invalid_argument for bad arguments and std::system_error when the memory
// cannot be had (ENOMEM, or EFAULT: a shared file whose filesystem is full), or when a
// thread cannot be started (RLIMIT_AS, RLIMIT_NPROC): then it touches nothing, as the
// threads start touching only once all have started.
void TouchPages(int64_t address, int64_t bytes, const std::vector<int>& cpus, int threads);

// Asks the kernel to place the pages of [address, address + bytes), when first touched,
// on NUMA node `node` (mbind, MPOL_PREFERRED). Throws std::system_error.
void PreferNumaNode(int64_t address, int64_t bytes, int node);

namespace testing {
// Stands in for madvise (nullptr: the real one) in TouchPages, to watch its calls.
using MadviseFunction = int (*)(void* address, size_t bytes, int advice);
void SetMadviseForTesting(MadviseFunction function);
}  // namespace testing

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_POOL_FIRST_TOUCH_H_
