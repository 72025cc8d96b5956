#ifndef KVOFFLOAD_CC_COPY_SLICE_CUTTER_H_
#define KVOFFLOAD_CC_COPY_SLICE_CUTTER_H_

// A staged copy's batch cut into ring slots: per slot, the DMA runs and the kernel pieces.

#include <cstdint>
#include <functional>
#include <vector>

#include "cc/copy/copy_batch.h"
#include "cc/copy/direction.h"

namespace kvoffload {

// What moves through one slot of the staged copy's ring: host runs (host <-> slot)
// and kernel pieces (slot <-> device blocks), each as [src..., dst..., size...] arrays.
struct Slice {
  std::vector<int64_t> dma_src, dma_dst, dma_size;
  std::vector<int64_t> piece_src, piece_dst, piece_size;
};

// Cuts a valid batch (ValidateCopyBatch), in host address order, into slices of at most
// slot_bytes, one at a time; every slice but the last is full. Copies are cut into
// pieces of at most piece_bytes (and at slice ends); pieces whose host bytes go on make
// one host run. Slot addresses are offsets into the slot until the ring relocates
// them. Borrows the batch's arrays.
// range_end(address), when given, is where the host memory holding `address` ends (its
// page-locked registration): a host run never goes past it, since cuMemcpyBatchAsync
// rejects a copy that spans two registrations.
class SliceCutter {
 public:
  using RangeEnd = std::function<int64_t(int64_t address)>;
  SliceCutter(const CopyBatch& batch, Direction direction, int64_t slot_bytes, int64_t piece_bytes,
              RangeEnd range_end = nullptr);

  // The next slice, or false when the batch is done.
  bool Next(Slice& s);

 private:
  const CopyBatch batch_;
  const Direction direction_;
  const int64_t slot_bytes_;
  const int64_t piece_bytes_;
  const int64_t* host_;
  const int64_t* device_;
  std::vector<int64_t> order_;
  int64_t at_ = 0;      // position in order_
  int64_t offset_ = 0;  // bytes of copy order_[at_] already cut
  RangeEnd range_end_;
  int64_t run_end_ = INT64_MAX;  // where the last host run's host range ends
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_SLICE_CUTTER_H_
