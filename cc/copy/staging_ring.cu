#include "cc/copy/staging_ring.h"

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "cc/cuda/cuda_check.h"

namespace kvoffload {

StagingRing& StagingRing::For(int device, Direction direction, int64_t slot_bytes, int slots, int ring) {
  using Key = std::tuple<int, Direction, int64_t, int, int>;
  static std::mutex mutex;
  // Never destroyed: rings outlive every stream that may still wait on them at exit.
  static auto* rings = new std::map<Key, std::unique_ptr<StagingRing>>();
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<StagingRing>& made = (*rings)[Key{device, direction, slot_bytes, slots, ring}];
  if (made == nullptr) made = std::make_unique<StagingRing>(slot_bytes, slots);
  return *made;
}

StagingRing::StagingRing(int64_t slot_bytes, int slots) : slot_bytes_(slot_bytes), slots_(slots) {
  CheckCuda(cudaMalloc(&memory_, slot_bytes * slots), "cudaMalloc (staging ring)");
  CheckCuda(cudaStreamCreateWithFlags(&dma_, cudaStreamNonBlocking), "cudaStreamCreate");
  int lowest = 0, highest = 0;
  CheckCuda(cudaDeviceGetStreamPriorityRange(&lowest, &highest),
            "cudaDeviceGetStreamPriorityRange");
  CheckCuda(cudaStreamCreateWithPriority(&kernel_, cudaStreamNonBlocking, highest),
            "cudaStreamCreateWithPriority");
  for (int i = 0; i < slots; ++i) {
    cudaEvent_t free_event, full_event;
    CheckCuda(cudaEventCreateWithFlags(&free_event, cudaEventDisableTiming), "cudaEventCreate");
    CheckCuda(cudaEventCreateWithFlags(&full_event, cudaEventDisableTiming), "cudaEventCreate");
    slot_free_.push_back(free_event);
    slot_full_.push_back(full_event);
  }
  CheckCuda(cudaEventCreateWithFlags(&fence_, cudaEventDisableTiming), "cudaEventCreate");
}

StagingRing::~StagingRing() {
  cudaStreamSynchronize(dma_);
  cudaStreamSynchronize(kernel_);
  for (cudaEvent_t e : slot_free_) cudaEventDestroy(e);
  for (cudaEvent_t e : slot_full_) cudaEventDestroy(e);
  cudaEventDestroy(fence_);
  cudaStreamDestroy(dma_);
  cudaStreamDestroy(kernel_);
  cudaFree(memory_);
}

void StagingRing::Begin(cudaStream_t caller) {
  CheckCuda(cudaEventRecord(fence_, caller), "cudaEventRecord");
  CheckCuda(cudaStreamWaitEvent(dma_, fence_, 0), "cudaStreamWaitEvent");
  CheckCuda(cudaStreamWaitEvent(kernel_, fence_, 0), "cudaStreamWaitEvent");
}

void StagingRing::End(cudaStream_t caller) {
  CheckCuda(cudaEventRecord(fence_, dma_), "cudaEventRecord");
  CheckCuda(cudaStreamWaitEvent(caller, fence_, 0), "cudaStreamWaitEvent");
  CheckCuda(cudaEventRecord(fence_, kernel_), "cudaEventRecord");
  CheckCuda(cudaStreamWaitEvent(caller, fence_, 0), "cudaStreamWaitEvent");
}

StagingRing::Slot StagingRing::Next() {
  const int index = next_slot_;
  next_slot_ = (next_slot_ + 1) % slots_;
  return Slot{index, reinterpret_cast<int64_t>(memory_) + index * slot_bytes_};
}

}  // namespace kvoffload
