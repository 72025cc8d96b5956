#ifndef KVOFFLOAD_CC_BATCH_COPY_H_
#define KVOFFLOAD_CC_BATCH_COPY_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cc/copy_batch.h"
#include "cc/copy_path.h"

namespace kvoffload {

struct BatchCopyOptions {
  // At most this many copies per driver call; 0 means the whole batch in one call.
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

// The cuMemcpyBatchAsync form the driver offers: 13000, 12080, or 0 for none.
int BatchEntryPointVersion();

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_BATCH_COPY_H_
