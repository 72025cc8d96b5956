#ifndef KVOFFLOAD_CC_COPY_HOST_COPY_H_
#define KVOFFLOAD_CC_COPY_HOST_COPY_H_

// kvoffload.host_copy: host-to-host copies, threaded, with no GPU.

#include "cc/copy/copy_batch.h"
#include "cc/copy/copy_path.h"

namespace kvoffload {

// Host-to-host copies with memcpy; needs no GPU. Batches of at least
// kHostThreadingBytes are split evenly by bytes over up to `max_threads` threads
// (0: the machine's core count, capped at 8; never more than kMaxHostThreads).
// No destination may overlap another range of the batch (std::invalid_argument names
// both copies); sources may overlap each other. Validates first; a failed
// validation, sizes adding up past int64, or a thread that cannot be started
// (std::runtime_error) copies nothing.
inline constexpr int64_t kHostThreadingBytes = int64_t{32} << 20;
inline constexpr int kMaxHostThreads = 64;

CopyResult HostCopy(const CopyBatch& batch, int max_threads = 0);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_HOST_COPY_H_
