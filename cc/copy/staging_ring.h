#ifndef KVOFFLOAD_CC_COPY_STAGING_RING_H_
#define KVOFFLOAD_CC_COPY_STAGING_RING_H_

// The device staging ring the staged copy and the page table's staged path pipeline
// through.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "cc/copy/direction.h"
#include "cc/cuda/cuda_check.h"

namespace kvoffload {

// A device staging ring: `slots` buffers of slot_bytes and two streams that pipeline
// through them, a DMA stream and a kernel stream at the highest priority (short
// gather/scatter kernels then take the next free SMs even beside a model's kernels).
// A load fills a slot by DMA and drains it with a kernel; a store the other way round.
// With in_l2 the slots are held in persisting L2 (the kernel stream's access policy
// window), so a slice need not cross HBM between the DMA and the kernel.
class StagingRing {
 public:
  // Ring number `ring` of `device` (current) for one direction and geometry, made on
  // first use and kept. Hold mutex() around Run().
  static StagingRing& For(int device, Direction direction, int64_t slot_bytes, int slots, int ring = 0,
                          bool in_l2 = false);

  // Throws std::invalid_argument naming slot_bytes when slots x slot_bytes exceed what
  // `device` can hold in persisting L2 (none where it has none).
  static void RequireFitsL2(int device, int64_t slot_bytes, int slots);

  std::mutex& mutex() { return mutex_; }

  // Both streams start after the work queued on `caller` so far, body() stages slices,
  // then `caller` waits for everything the ring enqueued, also when body() throws (what
  // was enqueued still runs).
  template <typename Body>
  void Run(cudaStream_t caller, Body body) {
    Begin(caller);
    try {
      body();
    } catch (...) {
      try {
        End(caller);
      } catch (...) {
      }
      throw;
    }
    End(caller);
  }

  struct Slot {
    int index;
    int64_t address;
  };
  // The next slot in turn.
  Slot Next();

  // Passes one slice through the slot once its last use is drained: dma(stream) on the
  // DMA stream and kernel(stream) on the kernel stream, the DMA first for a load (it
  // fills the slot that the kernel scatters) and the kernel first for a store.
  template <typename Dma, typename Kernel>
  void Stage(const Slot& slot, Direction direction, Dma dma, Kernel kernel) {
    if (direction == Direction::kLoad) {
      Pipe(slot, dma_, dma, kernel_, kernel);
    } else {
      Pipe(slot, kernel_, kernel, dma_, dma);
    }
  }

  cudaStream_t dma_stream() const { return dma_; }
  cudaStream_t kernel_stream() const { return kernel_; }

  StagingRing(int64_t slot_bytes, int slots);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

 private:
  template <typename First, typename Second>
  void Pipe(const Slot& slot, cudaStream_t a, First first, cudaStream_t b, Second second) {
    CheckCuda(cudaStreamWaitEvent(a, slot_free_[slot.index], 0), "cudaStreamWaitEvent");
    first(a);
    CheckCuda(cudaEventRecord(slot_full_[slot.index], a), "cudaEventRecord");
    CheckCuda(cudaStreamWaitEvent(b, slot_full_[slot.index], 0), "cudaStreamWaitEvent");
    second(b);
    CheckCuda(cudaEventRecord(slot_free_[slot.index], b), "cudaEventRecord");
  }

  // Grows the device's persisting set-aside by the slots and holds them in it (the kernel
  // stream's access policy window). cudaDeviceSetLimit waits for the device.
  void HoldInL2(int device);
  void Begin(cudaStream_t caller);
  void End(cudaStream_t caller);

  std::mutex mutex_;
  int64_t slot_bytes_;
  int slots_;
  void* memory_ = nullptr;
  cudaStream_t dma_ = nullptr, kernel_ = nullptr;
  std::vector<cudaEvent_t> slot_free_, slot_full_;
  cudaEvent_t fence_ = nullptr;
  int next_slot_ = 0;
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_STAGING_RING_H_
