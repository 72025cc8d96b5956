#include "cc/copy/copy_path.h"

namespace kvoffload {

CopyPath PathFor(PathReason reason) {
  switch (reason) {
    case PathReason::kEmptyBatch:
      return CopyPath::kNone;
    case PathReason::kBatchEntryPoint:
      return CopyPath::kBatch;
    case PathReason::kHostToHost:
      return CopyPath::kHost;
    case PathReason::kKernelRequested:
      return CopyPath::kKernel;
    case PathReason::kStagedRequested:
      return CopyPath::kStaged;
    case PathReason::kStridedRows:
      return CopyPath::kRows;
    default:
      return CopyPath::kPerCopy;
  }
}

const char* PathName(CopyPath path) {
  switch (path) {
    case CopyPath::kNone:
      return "none";
    case CopyPath::kBatch:
      return "batch";
    case CopyPath::kPerCopy:
      return "per_copy";
    case CopyPath::kHost:
      return "host";
    case CopyPath::kKernel:
      return "kernel";
    case CopyPath::kStaged:
      return "staged";
    case CopyPath::kRows:
      return "rows";
  }
  return "unknown";
}

const char* ReasonText(PathReason reason) {
  switch (reason) {
    case PathReason::kEmptyBatch:
      return "empty batch";
    case PathReason::kBatchEntryPoint:
      return "driver batch copy available";
    case PathReason::kRequested:
      return "per-copy requested by the caller";
    case PathReason::kLegacyStream:
      return "legacy default stream, which the batch copy rejects";
    case PathReason::kNoBatchEntryPoint:
      return "driver has no cuMemcpyBatchAsync";
    case PathReason::kDriverNotSupported:
      return "driver answered CUDA_ERROR_NOT_SUPPORTED to the batch copy";
    case PathReason::kHostToHost:
      return "host-to-host copy";
    case PathReason::kKernelRequested:
      return "copy kernel requested";
    case PathReason::kStagedRequested:
      return "staged copy requested";
    case PathReason::kStridedRows:
      return "2D copies of tensors a constant stride apart in one allocation";
  }
  return "unknown";
}

bool IsLegacyStream(uintptr_t stream) {
  // 0 is the null stream and 0x1 is cudaStreamLegacy; 0x2 (per-thread) is not legacy.
  return stream == 0x0 || stream == 0x1;
}

PathReason ChooseDevicePath(uintptr_t stream, bool batch_entry_point, bool per_copy_requested) {
  if (per_copy_requested) return PathReason::kRequested;
  if (IsLegacyStream(stream)) return PathReason::kLegacyStream;
  if (!batch_entry_point) return PathReason::kNoBatchEntryPoint;
  return PathReason::kBatchEntryPoint;
}

}  // namespace kvoffload
