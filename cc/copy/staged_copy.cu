#include "cc/copy/staged_copy.h"

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cc/copy/batch_copy.h"
#include "cc/copy/copy_kernel.h"
#include "cc/copy/slice_cutter.h"
#include "cc/copy/staging_ring.h"
#include "cc/cuda/cuda_check.h"
#include "cc/cuda/stream_device.h"
#include "cc/memory/memory_reach.h"

namespace kvoffload {
namespace {

// Slot offsets become addresses in the slot used.
void Relocate(Slice& slice, int64_t base, Direction direction) {
  for (int64_t& a : DeviceOf(direction, slice.dma_src, slice.dma_dst)) a += base;
  // A kernel piece's slot end stands where the host would.
  for (int64_t& a : HostOf(direction, slice.piece_src, slice.piece_dst)) a += base;
}

int64_t Dma(const Slice& s, Direction direction, cudaStream_t stream) {
  const CopyBatch batch{s.dma_src.data(), s.dma_dst.data(), s.dma_size.data(),
                        static_cast<int64_t>(s.dma_size.size())};
  return StagingDma(batch, direction, stream);
}

// Every slice's pieces in one upload, so that no upload (a host-to-device copy that
// would queue behind a load's DMA on the copy engine) comes between two kernels; the
// kernel of slice i copies pieces [first[i], first[i + 1]).
std::vector<int64_t> AllPieces(const std::vector<Slice>& slices, std::vector<int64_t>& first) {
  first.assign(1, 0);
  for (const Slice& s : slices) first.push_back(first.back() + static_cast<int64_t>(s.piece_size.size()));
  const int64_t total = first.back();
  std::vector<int64_t> pieces(3 * total);
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& s = slices[i];
    std::copy(s.piece_src.begin(), s.piece_src.end(), pieces.begin() + first[i]);
    std::copy(s.piece_dst.begin(), s.piece_dst.end(), pieces.begin() + total + first[i]);
    std::copy(s.piece_size.begin(), s.piece_size.end(), pieces.begin() + 2 * total + first[i]);
  }
  return pieces;
}

}  // namespace

CopyResult StagedCopy(const CopyBatch& batch, Direction direction, cudaStream_t stream,
                      const StagedCopyOptions& options) {
  ValidateCopyBatch(batch);
  if (options.slot_bytes < 4096 || options.slot_bytes % 256 != 0) {
    throw std::invalid_argument("slot_bytes: must be a multiple of 256 and >= 4096, got " +
                                std::to_string(options.slot_bytes));
  }
  if (options.slots < 2) {
    throw std::invalid_argument("slots: must be >= 2, got " + std::to_string(options.slots));
  }
  ValidateCtaBudget(options.max_ctas);
  CopyResult result;
  if (batch.count == 0) return result;
  RequireCudaDevice();
  StreamDeviceGuard guard(stream);
  const char* src = "src";
  const char* dst = "dst";
  RequireReachable(HostOf(direction, batch.src, batch.dst), batch.size, batch.count,
                   guard.device(), Reach::kPinnedHost, HostOf(direction, src, dst));
  RequireReachable(DeviceOf(direction, batch.src, batch.dst), batch.size, batch.count,
                   guard.device(), Reach::kDevice, DeviceOf(direction, src, dst));
  result.reason = PathReason::kStagedRequested;
  result.copies = batch.count;
  result.bytes = TotalBytes(batch);
  // Every slice is cut before the first is enqueued, and all stay alive until every
  // one is: enqueueing while cutting gained nothing measurable, and the bench then
  // crashed once in the driver's small host-to-device copies (H200, driver 580.159).
  std::vector<Slice> slices;
  MemoryMap registrations(AskDriver);
  SliceCutter cutter(batch, direction, options.slot_bytes, KernelCopyOptions{}.piece_bytes,
                     [&](int64_t address) { return registrations.At(address).end; });
  for (Slice slice; cutter.Next(slice);) slices.push_back(std::move(slice));

  // One ring per device and direction, so that loads and stores in flight at once use
  // separate streams and slots and overlap (the DMA engines run both ways at once).
  StagingRing& ring =
      StagingRing::For(guard.device(), direction, options.slot_bytes, options.slots);
  std::lock_guard<std::mutex> lock(ring.mutex());
  ring.Run(stream, [&] {
    std::vector<StagingRing::Slot> slots;
    for (Slice& slice : slices) {
      slots.push_back(ring.Next());
      Relocate(slice, slots.back().address, direction);
    }
    std::vector<int64_t> first;
    const PieceUpload upload(AllPieces(slices, first), ring.kernel_stream());
    for (size_t i = 0; i < slices.size(); ++i) {
      auto dma = [&](cudaStream_t s) { result.driver_calls += Dma(slices[i], direction, s); };
      auto kernel = [&](cudaStream_t) {
        upload.Launch(first[i], first[i + 1] - first[i], options.max_ctas);
      };
      ring.Stage(slots[i], direction, dma, kernel);
      ++result.driver_calls;  // the kernel
    }
  });
  return result;
}

}  // namespace kvoffload
