#include "cc/staged_copy.h"

#include <algorithm>
#include <map>
#include <memory>
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
#include "cc/stream_device.h"

namespace kvoffload {
namespace {

// What moves through one slot: DMA segments (host <-> slot) and kernel pieces
// (slot <-> device blocks), each as [src..., dst..., size...] arrays.
struct Slice {
  std::vector<int64_t> dma_src, dma_dst, dma_size;
  std::vector<int64_t> piece_src, piece_dst, piece_size;
};

// The device staging ring of one device, and the two streams that pipeline through it.
class StagingRing {
 public:
  explicit StagingRing(const StagedCopyOptions& options) : options_(options) {
    CheckCuda(cudaMalloc(&memory_, options.slot_bytes * options.slots), "cudaMalloc (staging)");
    CheckCuda(cudaStreamCreateWithFlags(&dma_, cudaStreamNonBlocking), "cudaStreamCreate");
    // The gather/scatter kernels are short; at the highest priority their CTAs take the
    // next free SMs even while a model's kernels fill the GPU, and the pipeline keeps up.
    int lowest = 0, highest = 0;
    CheckCuda(cudaDeviceGetStreamPriorityRange(&lowest, &highest),
              "cudaDeviceGetStreamPriorityRange");
    CheckCuda(cudaStreamCreateWithPriority(&kernel_, cudaStreamNonBlocking, highest),
              "cudaStreamCreateWithPriority");
    for (int i = 0; i < options.slots; ++i) {
      cudaEvent_t free_event, full_event;
      CheckCuda(cudaEventCreateWithFlags(&free_event, cudaEventDisableTiming), "cudaEventCreate");
      CheckCuda(cudaEventCreateWithFlags(&full_event, cudaEventDisableTiming), "cudaEventCreate");
      slot_free_.push_back(free_event);
      slot_full_.push_back(full_event);
    }
    CheckCuda(cudaEventCreateWithFlags(&fence_, cudaEventDisableTiming), "cudaEventCreate");
  }

  ~StagingRing() {
    cudaStreamSynchronize(dma_);
    cudaStreamSynchronize(kernel_);
    for (cudaEvent_t e : slot_free_) cudaEventDestroy(e);
    for (cudaEvent_t e : slot_full_) cudaEventDestroy(e);
    cudaEventDestroy(fence_);
    cudaStreamDestroy(dma_);
    cudaStreamDestroy(kernel_);
    cudaFree(memory_);
  }
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  bool Fits(const StagedCopyOptions& o) const {
    return o.slot_bytes == options_.slot_bytes && o.slots == options_.slots;
  }

  // Begin(stream), then Add() each slice, then End(stream): both internal streams start
  // after the caller's stream's work so far, and the caller's stream waits for both.
  void Begin(cudaStream_t stream) {
    CheckCuda(cudaEventRecord(fence_, stream), "cudaEventRecord");
    CheckCuda(cudaStreamWaitEvent(dma_, fence_, 0), "cudaStreamWaitEvent");
    CheckCuda(cudaStreamWaitEvent(kernel_, fence_, 0), "cudaStreamWaitEvent");
  }

  void Add(Slice& slice, bool load, int max_ctas) {
    cudaStream_t first = load ? dma_ : kernel_;
    cudaStream_t second = load ? kernel_ : dma_;
    const int slot = next_slot_;
    next_slot_ = (next_slot_ + 1) % options_.slots;
    const int64_t base = reinterpret_cast<int64_t>(memory_) + slot * options_.slot_bytes;
    Relocate(slice, base, load);
    CheckCuda(cudaStreamWaitEvent(first, slot_free_[slot], 0), "cudaStreamWaitEvent");
    load ? Dma(slice, first) : Kernel(slice, max_ctas, first);
    CheckCuda(cudaEventRecord(slot_full_[slot], first), "cudaEventRecord");
    CheckCuda(cudaStreamWaitEvent(second, slot_full_[slot], 0), "cudaStreamWaitEvent");
    load ? Kernel(slice, max_ctas, second) : Dma(slice, second);
    CheckCuda(cudaEventRecord(slot_free_[slot], second), "cudaEventRecord");
  }

  void End(cudaStream_t stream) {
    CheckCuda(cudaEventRecord(fence_, dma_), "cudaEventRecord");
    CheckCuda(cudaStreamWaitEvent(stream, fence_, 0), "cudaStreamWaitEvent");
    CheckCuda(cudaEventRecord(fence_, kernel_), "cudaEventRecord");
    CheckCuda(cudaStreamWaitEvent(stream, fence_, 0), "cudaStreamWaitEvent");
  }

 private:
  // Slot offsets become addresses in the slot used.
  static void Relocate(Slice& slice, int64_t base, bool load) {
    for (int64_t& a : load ? slice.dma_dst : slice.dma_src) a += base;
    for (int64_t& a : load ? slice.piece_src : slice.piece_dst) a += base;
  }

  static void Dma(const Slice& s, cudaStream_t stream) {
    const CopyBatch batch{s.dma_src.data(), s.dma_dst.data(), s.dma_size.data(),
                          static_cast<int64_t>(s.dma_size.size())};
    BatchCopy(batch, stream);
  }

  static void Kernel(const Slice& s, int max_ctas, cudaStream_t stream) {
    const int64_t n = s.piece_size.size();
    std::vector<int64_t> pieces(3 * n);
    std::copy(s.piece_src.begin(), s.piece_src.end(), pieces.begin());
    std::copy(s.piece_dst.begin(), s.piece_dst.end(), pieces.begin() + n);
    std::copy(s.piece_size.begin(), s.piece_size.end(), pieces.begin() + 2 * n);
    UploadAndLaunch(pieces, n, max_ctas, stream);
  }

  StagedCopyOptions options_;
  void* memory_ = nullptr;
  cudaStream_t dma_ = nullptr, kernel_ = nullptr;
  std::vector<cudaEvent_t> slot_free_, slot_full_;
  cudaEvent_t fence_ = nullptr;
  int next_slot_ = 0;
};

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
      if (!s.dma_size.empty() && dma_host.back() + s.dma_size.back() == host_[i] + offset_ &&
          dma_slot.back() + s.dma_size.back() == used) {
        s.dma_size.back() += n;  // the host run goes on
      } else {
        dma_host.push_back(host_[i] + offset_);
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
};

std::mutex rings_mutex;

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
  static std::map<std::pair<int, bool>, std::unique_ptr<StagingRing>>* rings =
      new std::map<std::pair<int, bool>, std::unique_ptr<StagingRing>>();
  std::lock_guard<std::mutex> lock(rings_mutex);
  std::unique_ptr<StagingRing>& ring = (*rings)[{guard.device(), host_is_src}];
  if (ring != nullptr && !ring->Fits(options)) {
    CheckCuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // the old ring drains
    ring.reset();
  }
  if (ring == nullptr) ring = std::make_unique<StagingRing>(options);
  ring->Begin(stream);
  try {
    for (Slice& slice : slices) {
      ring->Add(slice, host_is_src, options.max_ctas);
      ++result.driver_calls;
    }
  } catch (...) {
    // What was enqueued still runs: the caller's stream must still wait for it.
    try {
      ring->End(stream);
    } catch (...) {
    }
    throw;
  }
  ring->End(stream);
  return result;
}

}  // namespace kvoffload
