#include "cc/copy/copy_kernel.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/copy/warp_copy.h"
#include "cc/cuda/cuda_check.h"
#include "cc/cuda/load_kernel.h"
#include "cc/cuda/stream_device.h"
#include "cc/memory/memory_reach.h"

namespace kvoffload {
namespace {

constexpr int kThreads = 1024;
// Copies per launch: few enough that the host prepares the next launch while the GPU
// runs this one (4 KiB copies: about 0.5 ms of host work), many enough that launch gaps
// cost under 1%.
constexpr int64_t kCopiesPerLaunch = 8192;
constexpr int64_t kBytesPerLaunch = int64_t{64} << 20;

__global__ void __launch_bounds__(kThreads)
    CopyPiecesKernel(const int64_t* src, const int64_t* dst, const int64_t* size, int64_t count) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / kWarpSize);
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kWarpSize;
       i < count; i += warps) {
    WarpCopy(reinterpret_cast<const char*>(src[i]), reinterpret_cast<char*>(dst[i]), size[i],
             lane);
  }
}

void LaunchCopyKernel(const int64_t* device_src, const int64_t* device_dst,
                      const int64_t* device_size, int64_t count, int max_ctas,
                      cudaStream_t stream) {
  if (count == 0) return;
  const int64_t warps_needed = (count + kWarpSize - 1) / kWarpSize;
  const int ctas = static_cast<int>(std::min<int64_t>(max_ctas, warps_needed));
  CopyPiecesKernel<<<ctas, kThreads, 0, stream>>>(device_src, device_dst, device_size, count);
}

}  // namespace

void LoadCopyKernel() {
  LoadKernel(CopyPiecesKernel, "cudaFuncGetAttributes(copy kernel)");
}

void ValidateCtaBudget(int max_ctas) {
  if (max_ctas < 1) {
    throw std::invalid_argument("max_ctas: must be >= 1, got " + std::to_string(max_ctas));
  }
}

PieceUpload::PieceUpload(const std::vector<int64_t>& pieces, cudaStream_t stream)
    : stream_(stream),
      total_(static_cast<int64_t>(pieces.size() / 3)),
      upload_({{pieces.data(), pieces.size() * sizeof(int64_t)}}, stream) {}

void PieceUpload::Launch(int64_t first, int64_t count, int max_ctas) const {
  const int64_t* d = upload_.array<int64_t>(0) + first;
  LaunchCopyKernel(d, d + total_, d + 2 * total_, count, max_ctas, stream_);
  CheckCuda(cudaGetLastError(), "copy kernel launch");
}

CopyResult KernelCopy(const CopyBatch& batch, cudaStream_t stream,
                      const KernelCopyOptions& options) {
  ValidateCopyBatch(batch);
  ValidateCtaBudget(options.max_ctas);
  if (options.piece_bytes < 16) {
    throw std::invalid_argument("piece_bytes: must be >= 16, got " +
                                std::to_string(options.piece_bytes));
  }
  CopyResult result;
  if (batch.count == 0) return result;
  RequireCudaDevice();
  StreamDeviceGuard guard(stream);
  RequireReachable(batch.src, batch.size, batch.count, guard.device(), Reach::kDeviceOrPinnedHost,
                   "src");
  RequireReachable(batch.dst, batch.size, batch.count, guard.device(), Reach::kDeviceOrPinnedHost,
                   "dst");
  result.reason = PathReason::kKernelRequested;
  result.copies = batch.count;
  result.bytes = TotalBytes(batch);

  // Launch by launch, so that the GPU copies while the host prepares the next launch.
  std::vector<int64_t> pieces;
  for (int64_t begin = 0; begin < batch.count; ++result.driver_calls) {
    int64_t end = begin, bytes = 0;
    while (end < batch.count && end - begin < kCopiesPerLaunch && bytes < kBytesPerLaunch) {
      bytes += batch.size[end++];
    }
    const CopyBatch launch{batch.src + begin, batch.dst + begin, batch.size + begin, end - begin};
    const int64_t count = SplitIntoPieces(launch, options.piece_bytes, pieces);
    PieceUpload(pieces, stream).Launch(0, count, options.max_ctas);
    begin = end;
  }
  return result;
}

}  // namespace kvoffload
