#ifndef KVOFFLOAD_CC_COPY_COPY_PATH_H_
#define KVOFFLOAD_CC_COPY_COPY_PATH_H_

// Which path a batch took (CopyPath) and why, as every copy call reports it
// (kvoffload.CopyResult).

#include <cstdint>

namespace kvoffload {

enum class CopyPath : uint8_t {
  kNone,     // nothing to copy
  kBatch,    // cuMemcpyBatchAsync
  kPerCopy,  // one cudaMemcpyAsync per copy
  kHost,     // memcpy on the host
  kKernel,   // an SM copy kernel
  kStaged,   // DMA of large host runs through a device staging ring, plus a kernel
  kRows,     // cudaMemcpy2DAsync, a row per tensor
};

// Why a batch took its path. Every per-copy reason is named; there is no silent fallback.
enum class PathReason : uint8_t {
  kEmptyBatch,
  kBatchEntryPoint,     // the driver's batch copy was resolved
  kRequested,           // the caller asked for per-copy
  kLegacyStream,        // stream 0 or cudaStreamLegacy: the batch call rejects it
  kNoBatchEntryPoint,   // the driver has no cuMemcpyBatchAsync
  kDriverNotSupported,  // the batch call answered CUDA_ERROR_NOT_SUPPORTED
  kHostToHost,
  kKernelRequested,  // the caller chose the copy kernel
  kStagedRequested,  // the caller chose the staged copy
  kStridedRows,      // 2D copies, a row per tensor of one allocation (cc/pages/row_copies.h)
};

CopyPath PathFor(PathReason reason);
const char* PathName(CopyPath path);
const char* ReasonText(PathReason reason);

// The handles the runtime reserves for the legacy default stream.
bool IsLegacyStream(uintptr_t stream);

// The path a non-empty device batch takes before the driver is called.
PathReason ChooseDevicePath(uintptr_t stream, bool batch_entry_point, bool per_copy_requested);

struct CopyResult {
  PathReason reason = PathReason::kEmptyBatch;
  int64_t copies = 0;
  int64_t bytes = 0;
  // Batch calls, per-copy calls, or host threads used; for a staged or page copy, its
  // DMA's driver calls and its kernel launches.
  int64_t driver_calls = 0;
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_COPY_PATH_H_
