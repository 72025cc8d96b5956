#include "cc/staged_copy.h"

#include <algorithm>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cc/batch_copy.h"
#include "cc/copy_kernel.h"
#include "cc/cuda_check.h"
#include "cc/memory_reach.h"
#include "cc/staging_ring.h"
#include "cc/stream_device.h"

namespace kvoffload {
namespace {

// What moves through one slot: DMA segments (host <-> slot) and kernel pieces
// (slot <-> device blocks), each as [src..., dst..., size...] arrays.
struct Slice {
  std::vector<int64_t> dma_src, dma_dst, dma_size;
  std::vector<int64_t> piece_src, piece_dst, piece_size;
};

// Slot offsets become addresses in the slot used.
void Relocate(Slice& slice, int64_t base, bool load) {
  for (int64_t& a : load ? slice.dma_dst : slice.dma_src) a += base;
  for (int64_t& a : load ? slice.piece_src : slice.piece_dst) a += base;
}

void Dma(const Slice& s, cudaStream_t stream) {
  const CopyBatch batch{s.dma_src.data(), s.dma_dst.data(), s.dma_size.data(),
                        static_cast<int64_t>(s.dma_size.size())};
  BatchCopy(batch, stream);
}

void Kernel(const Slice& s, int max_ctas, cudaStream_t stream) {
  const int64_t n = s.piece_size.size();
  std::vector<int64_t> pieces(3 * n);
  std::copy(s.piece_src.begin(), s.piece_src.end(), pieces.begin());
  std::copy(s.piece_dst.begin(), s.piece_dst.end(), pieces.begin() + n);
  std::copy(s.piece_size.begin(), s.piece_size.end(), pieces.begin() + 2 * n);
  UploadAndLaunch(pieces, n, max_ctas, stream);
}

constexpr int64_t kPieceBytes = int64_t{64} << 10;

// Cuts the batch, in host address order, into slices of at most slot_bytes, one at a
// time. Offsets into the slot are relative until the ring relocates them.
class SliceCutter {
 public:
  SliceCutter(const CopyBatch& batch, bool load, int64_t slot_bytes)
      : batch_(batch),
        load_(load),
        slot_bytes_(slot_bytes),
        host_(load ? batch.src : batch.dst),
        device_(load ? batch.dst : batch.src),
        order_(batch.count) {
    std::iota(order_.begin(), order_.end(), 0);
    if (!std::is_sorted(host_, host_ + batch.count)) {
      std::sort(order_.begin(), order_.end(),
                [&](int64_t a, int64_t b) { return host_[a] < host_[b]; });
    }
  }

  // The next slice, or false when the batch is done.
  bool Next(Slice& s) {
    for (auto* v : {&s.dma_src, &s.dma_dst, &s.dma_size, &s.piece_src, &s.piece_dst,
                    &s.piece_size}) {
      v->clear();
    }
    int64_t used = 0;  // bytes of the slot
    while (at_ < batch_.count && used < slot_bytes_) {
      const int64_t i = order_[at_];
      const int64_t n = std::min({batch_.size[i] - offset_, slot_bytes_ - used, kPieceBytes});
      std::vector<int64_t>& dma_host = load_ ? s.dma_src : s.dma_dst;
      std::vector<int64_t>& dma_slot = load_ ? s.dma_dst : s.dma_src;
      const int64_t host = host_[i] + offset_;
      if (!s.dma_size.empty() && dma_host.back() + s.dma_size.back() == host &&
          dma_slot.back() + s.dma_size.back() == used && (offset_ > 0 || host < run_end_)) {
        s.dma_size.back() += n;  // the host run goes on, inside one registration
      } else {
        run_end_ = ranges_.End(host);
        dma_host.push_back(host);
        dma_slot.push_back(used);
        s.dma_size.push_back(n);
      }
      (load_ ? s.piece_src : s.piece_dst).push_back(used);
      (load_ ? s.piece_dst : s.piece_src).push_back(device_[i] + offset_);
      s.piece_size.push_back(n);
      used += n;
      offset_ += n;
      if (offset_ == batch_.size[i]) {
        offset_ = 0;
        ++at_;
      }
    }
    return used > 0;
  }

 private:
  const CopyBatch& batch_;
  const bool load_;
  const int64_t slot_bytes_;
  const int64_t* host_;
  const int64_t* device_;
  std::vector<int64_t> order_;
  int64_t at_ = 0;      // position in order_
  int64_t offset_ = 0;  // bytes of copy order_[at_] already cut
  AddressRanges ranges_;
  int64_t run_end_ = 0;  // where the registration of the last DMA run's start ends
};

}  // namespace

CopyResult StagedCopy(const CopyBatch& batch, bool host_is_src, cudaStream_t stream,
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
  const int64_t* host = host_is_src ? batch.src : batch.dst;
  const int64_t* device = host_is_src ? batch.dst : batch.src;
  RequireReachable(host, batch.size, batch.count, guard.device(), Reach::kPinnedHost,
                   host_is_src ? "src" : "dst");
  RequireReachable(device, batch.size, batch.count, guard.device(), Reach::kDevice,
                   host_is_src ? "dst" : "src");
  result.reason = PathReason::kStagedRequested;
  result.copies = batch.count;
  result.bytes = TotalBytes(batch);
  // Every slice is cut before the first is enqueued, and all stay alive until every
  // one is: enqueueing while cutting gained nothing measurable, and the bench then
  // crashed once in the driver's small host-to-device copies (H200, driver 580.159).
  std::vector<Slice> slices;
  SliceCutter cutter(batch, host_is_src, options.slot_bytes);
  for (Slice slice; cutter.Next(slice);) slices.push_back(std::move(slice));

  // One ring per device and direction, so that loads and stores in flight at once use
  // separate streams and slots and overlap (the DMA engines run both ways at once).
  StagingRing& ring =
      StagingRing::For(guard.device(), host_is_src, options.slot_bytes, options.slots);
  std::lock_guard<std::mutex> lock(ring.mutex());
  ring.Run(stream, [&] {
    for (Slice& slice : slices) {
      const StagingRing::Slot slot = ring.Next();
      Relocate(slice, slot.address, host_is_src);
      const bool load = host_is_src;
      ring.Stage(
          slot, load,
          [&](cudaStream_t s) { load ? Dma(slice, s) : Kernel(slice, options.max_ctas, s); },
          [&](cudaStream_t s) { load ? Kernel(slice, options.max_ctas, s) : Dma(slice, s); });
      ++result.driver_calls;
    }
  });
  return result;
}

}  // namespace kvoffload
