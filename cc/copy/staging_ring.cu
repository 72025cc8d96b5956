#include "cc/copy/staging_ring.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "cc/cuda/cuda_check.h"

namespace kvoffload {

StagingRing& StagingRing::For(int device, Direction direction, int64_t slot_bytes, int slots, int ring,
                              bool in_l2) {
  using Key = std::tuple<int, Direction, int64_t, int, int, bool>;
  static std::mutex mutex;
  // Never destroyed: rings outlive every stream that may still wait on them at exit.
  static auto* rings = new std::map<Key, std::unique_ptr<StagingRing>>();
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<StagingRing>& made = (*rings)[Key{device, direction, slot_bytes, slots, ring, in_l2}];
  if (made == nullptr) {
    if (in_l2) RequireFitsL2(device, slot_bytes, slots);
    auto ring = std::make_unique<StagingRing>(slot_bytes, slots);
    if (in_l2) ring->HoldInL2(device);  // on a throw, the ring is freed and the next copy tries again
    made = std::move(ring);
  }
  return *made;
}

void StagingRing::RequireFitsL2(int device, int64_t slot_bytes, int slots) {
  int window = 0, persisting = 0;
  CheckCuda(cudaDeviceGetAttribute(&window, cudaDevAttrMaxAccessPolicyWindowSize, device),
            "cudaDeviceGetAttribute(cudaDevAttrMaxAccessPolicyWindowSize)");
  CheckCuda(cudaDeviceGetAttribute(&persisting, cudaDevAttrMaxPersistingL2CacheSize, device),
            "cudaDeviceGetAttribute(cudaDevAttrMaxPersistingL2CacheSize)");
  const int64_t most = std::min<int64_t>(window, persisting);
  if (slot_bytes * slots > most) {
    throw std::invalid_argument("slot_bytes: slots x slot_bytes (" + std::to_string(slots) + " x " +
                                std::to_string(slot_bytes) + ") must fit the " + std::to_string(most) +
                                " bytes this device can hold in persisting L2 (slots_in_l2)");
  }
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

// The set-aside is the device's: it grows from whatever it was (the model's own, other
// rings'), up to the device's maximum. For() holds its lock here, so rings grow it in turn.
void StagingRing::HoldInL2(int device) {
  int most = 0;
  CheckCuda(cudaDeviceGetAttribute(&most, cudaDevAttrMaxPersistingL2CacheSize, device),
            "cudaDeviceGetAttribute(cudaDevAttrMaxPersistingL2CacheSize)");
  size_t held = 0;
  CheckCuda(cudaDeviceGetLimit(&held, cudaLimitPersistingL2CacheSize),
            "cudaDeviceGetLimit(cudaLimitPersistingL2CacheSize)");
  cudaStreamAttrValue value = {};
  value.accessPolicyWindow.base_ptr = memory_;
  value.accessPolicyWindow.num_bytes = static_cast<size_t>(slot_bytes_ * slots_);
  value.accessPolicyWindow.hitRatio = 1.0f;
  value.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
  value.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
  CheckCuda(cudaStreamSetAttribute(kernel_, cudaStreamAttributeAccessPolicyWindow, &value),
            "cudaStreamSetAttribute(cudaStreamAttributeAccessPolicyWindow)");
  const int64_t grown = std::min<int64_t>(most, static_cast<int64_t>(held) + slot_bytes_ * slots_);
  CheckCuda(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, static_cast<size_t>(grown)),
            "cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize)");
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
