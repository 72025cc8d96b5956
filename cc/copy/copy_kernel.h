#ifndef KVOFFLOAD_CC_COPY_COPY_KERNEL_H_
#define KVOFFLOAD_CC_COPY_COPY_KERNEL_H_

// The SM copy kernel: a batch cut into pieces, one warp a piece, on a budget of CTAs.
// kvoffload.kernel_copy and the staged copy's gather and scatter run it.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "cc/copy/copy_batch.h"
#include "cc/copy/copy_path.h"
#include "cc/copy/copy_pieces.h"
#include "cc/copy/stream_upload.h"

namespace kvoffload {

struct KernelCopyOptions {
  // CTAs of 1024 threads the kernel may use (the SM budget); at least 1.
  int max_ctas = 8;
  // Copies larger than this are split so that warps share the work.
  int64_t piece_bytes = int64_t{64} << 10;
};

// Copies the batch on `stream` with an SM kernel: each warp moves one piece at a time
// with 16-byte accesses where source and destination share their alignment, and
// 8 loads in flight per thread. Both ends of every copy must be device memory or
// page-locked (mapped) host memory, else std::invalid_argument (RequireReachable). The
// batch goes in several launches (driver_calls), pipelined with the host's preparation;
// descriptors go to the device in stream order and are freed after each kernel.
CopyResult KernelCopy(const CopyBatch& batch, cudaStream_t stream,
                      const KernelCopyOptions& options = {});

// Pieces ([src..., dst..., size...], as SplitIntoPieces makes them) uploaded in stream
// order on `stream`; Launch runs the copy kernel over a range of them on that stream.
class PieceUpload {
 public:
  PieceUpload(const std::vector<int64_t>& pieces, cudaStream_t stream);
  // Pieces [first, first + count). Throws CudaError.
  void Launch(int64_t first, int64_t count, int max_ctas) const;

 private:
  cudaStream_t stream_;
  int64_t total_;
  StreamUpload upload_;
};

// Loads the copy kernel into the current device's context now (LoadKernel).
void LoadCopyKernel();

// Throws std::invalid_argument unless max_ctas >= 1.
void ValidateCtaBudget(int max_ctas);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_COPY_KERNEL_H_
