#ifndef KVOFFLOAD_CC_COPY_STAGED_COPY_H_
#define KVOFFLOAD_CC_COPY_STAGED_COPY_H_

// kvoffload.staged_copy: DMA through a device staging ring plus a gather or scatter kernel,
// for batches of small copies.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cc/copy/copy_batch.h"
#include "cc/copy/copy_path.h"
#include "cc/copy/direction.h"

namespace kvoffload {

struct StagedCopyOptions {
  int64_t slot_bytes = int64_t{16} << 20;  // one DMA slice
  int slots = 4;                           // slices in flight in the device ring
  int max_ctas = 8;                        // CTAs of the gather/scatter kernel
};

// A copy between scattered device blocks and host memory that comes in large runs.
// A load (host to device) moves the host runs by DMA into a slot of a device staging ring,
// then a kernel scatters the slot into the device blocks; a store gathers device blocks
// into a slot with a kernel, then moves it to the host runs by DMA. Slices pipeline:
// the DMA of one overlaps the kernel of the next. The kernels' pieces (24 bytes each, of
// at most 64 KiB) go to the device in one upload before the first slice. Any number of
// copies and bytes; the ring wraps. In stream order on `stream`. Host memory must be
// page-locked and device memory the stream's device's, else std::invalid_argument
// (RequireReachable).
CopyResult StagedCopy(const CopyBatch& batch, Direction direction, cudaStream_t stream,
                      const StagedCopyOptions& options = {});

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_STAGED_COPY_H_
