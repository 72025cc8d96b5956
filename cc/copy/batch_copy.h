#ifndef KVOFFLOAD_CC_COPY_BATCH_COPY_H_
#define KVOFFLOAD_CC_COPY_BATCH_COPY_H_

// The batch copy: cuMemcpyBatchAsync, at most kCopiesPerDriverCall copies a driver call,
// with a per-copy fallback taken only for its named reason. kvoffload.batch_copy, the page
// copies' DMA path and the staged copy's host side call it.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cc/copy/copy_batch.h"
#include "cc/copy/copy_path.h"
#include "cc/copy/direction.h"

namespace kvoffload {

// The driver's CPU time per copy inside cuMemcpyBatchAsync grows with the copies in one
// call: calls of 256 were the fastest, or within noise of it, at 4-64 KiB both ways
// (docs/studies.md#batch-call-size).
constexpr int64_t kCopiesPerDriverCall = 256;

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
// Throws CudaError (NoCudaDeviceError without a GPU) for any failing CUDA call. The
// batch goes in driver calls of at most max_copies_per_call: a failing call leaves the
// copies of the calls before it enqueued (its error says so), and a call answered
// CUDA_ERROR_NOT_SUPPORTED sends its copies and the rest one by one (the result then
// names that reason, its driver_calls counting the calls of both paths).
CopyResult BatchCopy(const CopyBatch& batch, cudaStream_t stream,
                     const BatchCopyOptions& options = {});

// The DMA side of a staged or page copy, between host runs and a staging ring slot;
// returns the driver calls made. cuMemcpyBatchAsync of driver 580.159 dereferenced a
// null pointer inside the driver (H200) on slices of 4,096 4 KiB host-to-device copies
// enqueued on the ring's stream behind its slot events, once in two 12-second runs;
// plain batches of the same copies did not crash. So host-to-device copies under
// kSmallStagingLoad go one cudaMemcpyAsync each, and the rest of the slice in batches.
constexpr int64_t kSmallStagingLoad = int64_t{64} << 10;
int64_t StagingDma(const CopyBatch& batch, Direction direction, cudaStream_t stream);

// The cuMemcpyBatchAsync form the driver offers: 13000, 12080, or 0 for none.
int BatchEntryPointVersion();

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_BATCH_COPY_H_
