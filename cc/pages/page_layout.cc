#include "cc/pages/page_layout.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvoffload {
namespace {

// base + (count - 1) * stride + span, or -1 if it does not fit in int64.
int64_t ExtentEnd(int64_t base, int64_t stride, int64_t span, int64_t count) {
  if (count == 0) return base;
  int64_t offset = 0, end = 0;
  if (__builtin_mul_overflow(count - 1, stride, &offset) ||
      __builtin_add_overflow(base, offset, &end) || __builtin_add_overflow(end, span, &end)) {
    return -1;
  }
  return end;
}

}  // namespace

PageLayout::PageLayout(std::vector<TensorRef> refs, const std::vector<int64_t>& group_refs,
                       std::vector<int64_t> gpu_blocks, std::vector<int64_t> cpu_chunks,
                       int64_t blocks_per_chunk)
    : refs_(std::move(refs)),
      gpu_blocks_(std::move(gpu_blocks)),
      cpu_chunks_(std::move(cpu_chunks)),
      blocks_per_chunk_(blocks_per_chunk) {
  const size_t groups = group_refs.size();
  if (gpu_blocks_.size() != groups || cpu_chunks_.size() != groups) {
    throw std::invalid_argument("gpu_blocks, cpu_chunks: need one entry per group (" + std::to_string(groups) + ")");
  }
  if (blocks_per_chunk < 1) throw std::invalid_argument("blocks_per_chunk: must be >= 1, got " + std::to_string(blocks_per_chunk));
  first_ref_.push_back(0);
  for (size_t g = 0; g < groups; ++g) {
    if (group_refs[g] < 0) throw std::invalid_argument("group_refs[" + std::to_string(g) + "]: must be >= 0");
    if (gpu_blocks_[g] < 0 || cpu_chunks_[g] < 0) {
      throw std::invalid_argument("group " + std::to_string(g) + ": block and chunk counts must be >= 0");
    }
    // A block's place among its chunks' sub-blocks is below blocks_per_chunk + its count.
    if (gpu_blocks_[g] > INT64_MAX - blocks_per_chunk) {
      throw std::invalid_argument("group " + std::to_string(g) + ": " + std::to_string(gpu_blocks_[g]) + " blocks and blocks_per_chunk " +
             std::to_string(blocks_per_chunk) + " add up past 2^63 - 1");
    }
    first_ref_.push_back(first_ref_.back() + group_refs[g]);
  }
  if (first_ref_.back() != static_cast<int64_t>(refs_.size())) {
    throw std::invalid_argument("refs: has " + std::to_string(refs_.size()) + " entries but group_refs add up to " +
           std::to_string(first_ref_.back()));
  }
  for (size_t g = 0; g < groups; ++g) {
    bool chunk_major = true;
    int64_t chunk_offset = 0;
    for (int64_t r = first_ref_[g]; r < first_ref_[g + 1]; ++r) {
      const TensorRef& t = refs_[r];
      const std::string name = "group " + std::to_string(g) + " tensor " + std::to_string(r - first_ref_[g]);
      if (t.page_bytes < 1) throw std::invalid_argument(name + ": page_bytes must be >= 1");
      if ((gpu_blocks_[g] > 0 && t.gpu_base < 1) || (cpu_chunks_[g] > 0 && t.cpu_base < 1)) {
        throw std::invalid_argument(name + ": base addresses must be > 0");
      }
      if (t.gpu_stride < t.page_bytes) throw std::invalid_argument(name + ": gpu_stride is smaller than the page");
      int64_t chunk_bytes = 0;
      if (__builtin_mul_overflow(blocks_per_chunk, t.page_bytes, &chunk_bytes) ||
          t.cpu_stride < chunk_bytes) {
        throw std::invalid_argument(name + ": cpu_stride cannot hold " + std::to_string(blocks_per_chunk) + " pages");
      }
      const int64_t gpu_end = ExtentEnd(t.gpu_base, t.gpu_stride, t.page_bytes, gpu_blocks_[g]);
      const int64_t cpu_end = ExtentEnd(t.cpu_base, t.cpu_stride, chunk_bytes, cpu_chunks_[g]);
      if (gpu_end < 0 || cpu_end < 0) {
        throw std::invalid_argument(name + ": its extent runs past the end of the address space");
      }
      gpu_span_.push_back(gpu_end - t.gpu_base);
      cpu_span_.push_back(cpu_end - t.cpu_base);
      const TensorRef& first = refs_[first_ref_[g]];
      chunk_major = chunk_major && t.cpu_stride == first.cpu_stride &&
                    t.cpu_base == first.cpu_base + chunk_offset;
      chunk_offset += chunk_bytes;
    }
    chunk_major_.push_back(chunk_major ? 1 : 0);
  }
}

void PageLayout::set_host_breaks(std::vector<int64_t> breaks) {
  std::sort(breaks.begin(), breaks.end());
  host_breaks_ = std::move(breaks);
}

bool PageLayout::host_break(int64_t address) const {
  return std::binary_search(host_breaks_.begin(), host_breaks_.end(), address);
}

int64_t PageLayout::next_host_break(int64_t address) const {
  const auto next = std::upper_bound(host_breaks_.begin(), host_breaks_.end(), address);
  return next == host_breaks_.end() ? std::numeric_limits<int64_t>::max() : *next;
}

}  // namespace kvoffload
