#ifndef KVOFFLOAD_CC_BATCH_COPY_H_
#define KVOFFLOAD_CC_BATCH_COPY_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cc/copy_batch.h"
#include "cc/copy_path.h"

namespace kvoffload {

// The driver's CPU time per copy inside cuMemcpyBatchAsync grows with the copies in one
// call: on the H200 (driver 580.159) 4 KiB host-to-device copies moved 2.2 GB/s in calls
// of 65,536, 6.3 in calls of 1,024 and 7.3 in calls of 256; device-to-host 6.4 and 8.8.
constexpr int64_t kCopiesPerDriverCall = 1024;

struct BatchCopyOptions {
  // At most this many copies per driver call; 0 means kCopiesPerDriverCall.
  int64_t max_copies_per_call = 0;
  // Take the per-copy path (e.g. to measure it); reported as PathReason::kRequested.
  bool per_copy = false;
};

// Enqueues the batch on `stream` with cuMemcpyBatchAsync, or with one
// cudaMemcpyAsync per copy for the reason the result names. Device, pinned and
// managed memory in any direction. Validates first; a failed validation copies
// nothing. Copies with kDuringApiCall have read their source when this returns.
// Throws CudaError (NoCudaDeviceError without a GPU) for any failing CUDA call.
CopyResult BatchCopy(const CopyBatch& batch, cudaStream_t stream,
                     const BatchCopyOptions& options = {});

// The DMA side of a staged or page copy, between host runs and a staging ring slot.
// cuMemcpyBatchAsync of driver 580.159 dereferenced a null pointer inside the driver
// (H200) on slices of 4,096 4 KiB host-to-device copies enqueued on the ring's stream
// behind its slot events, once in two 12-second runs; plain batches of the same copies
// did not crash. So a host-to-device slice holding a copy under 64 KiB (those the driver
// moves through the CPU) goes one cudaMemcpyAsync per copy (PathReason::kRequested).
CopyResult StagingDma(const CopyBatch& batch, bool host_to_device, cudaStream_t stream);

// The cuMemcpyBatchAsync form the driver offers: 13000, 12080, or 0 for none.
int BatchEntryPointVersion();

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_BATCH_COPY_H_
