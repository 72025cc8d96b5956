#ifndef KVOFFLOAD_CC_SLICE_CUTTER_H_
#define KVOFFLOAD_CC_SLICE_CUTTER_H_

#include <cstdint>
#include <vector>

#include "cc/copy_batch.h"

namespace kvoffload {

// What moves through one slot of the staged copy's ring: DMA segments (host <-> slot)
// and kernel pieces (slot <-> device blocks), each as [src..., dst..., size...] arrays.
struct Slice {
  std::vector<int64_t> dma_src, dma_dst, dma_size;
  std::vector<int64_t> piece_src, piece_dst, piece_size;
};

// Cuts a valid batch (ValidateCopyBatch), in host address order, into slices of at most
// slot_bytes, one at a time; every slice but the last is full. Copies are cut into
// pieces of at most piece_bytes (and at slice ends); pieces whose host bytes go on make
// one DMA segment. Slot addresses are offsets into the slot until the ring relocates
// them. `load`: the host side is the source. Borrows the batch's arrays.
class SliceCutter {
 public:
  SliceCutter(const CopyBatch& batch, bool load, int64_t slot_bytes, int64_t piece_bytes);

  // The next slice, or false when the batch is done.
  bool Next(Slice& s);

 private:
  const CopyBatch batch_;
  const bool load_;
  const int64_t slot_bytes_;
  const int64_t piece_bytes_;
  const int64_t* host_;
  const int64_t* device_;
  std::vector<int64_t> order_;
  int64_t at_ = 0;      // position in order_
  int64_t offset_ = 0;  // bytes of copy order_[at_] already cut
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_SLICE_CUTTER_H_
