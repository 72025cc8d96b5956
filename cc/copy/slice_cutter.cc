#include "cc/copy/slice_cutter.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

namespace kvoffload {

SliceCutter::SliceCutter(const CopyBatch& batch, Direction direction, int64_t slot_bytes,
                         int64_t piece_bytes, RangeEnd range_end)
    : batch_(batch),
      direction_(direction),
      slot_bytes_(slot_bytes),
      piece_bytes_(piece_bytes),
      host_(HostOf(direction, batch.src, batch.dst)),
      device_(DeviceOf(direction, batch.src, batch.dst)),
      order_(batch.count),
      range_end_(std::move(range_end)) {
  std::iota(order_.begin(), order_.end(), 0);
  if (!std::is_sorted(host_, host_ + batch.count)) {
    std::sort(order_.begin(), order_.end(),
              [&](int64_t a, int64_t b) { return host_[a] < host_[b]; });
  }
}

bool SliceCutter::Next(Slice& s) {
  for (auto* v : {&s.dma_src, &s.dma_dst, &s.dma_size, &s.piece_src, &s.piece_dst,
                  &s.piece_size}) {
    v->clear();
  }
  int64_t used = 0;  // bytes of the slot
  while (at_ < batch_.count && used < slot_bytes_) {
    const int64_t i = order_[at_];
    const int64_t n = std::min({batch_.size[i] - offset_, slot_bytes_ - used, piece_bytes_});
    std::vector<int64_t>& dma_host = HostOf(direction_, s.dma_src, s.dma_dst);
    std::vector<int64_t>& dma_slot = DeviceOf(direction_, s.dma_src, s.dma_dst);
    const int64_t host = host_[i] + offset_;
    if (!s.dma_size.empty() && dma_host.back() + s.dma_size.back() == host &&
        dma_slot.back() + s.dma_size.back() == used && (offset_ > 0 || host < run_end_)) {
      s.dma_size.back() += n;  // the host run goes on
    } else {
      if (range_end_) run_end_ = range_end_(host);
      dma_host.push_back(host);
      dma_slot.push_back(used);
      s.dma_size.push_back(n);
    }
    HostOf(direction_, s.piece_src, s.piece_dst).push_back(used);  // the slot, host-side
    DeviceOf(direction_, s.piece_src, s.piece_dst).push_back(device_[i] + offset_);
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

}  // namespace kvoffload
