#include "cc/pages/page_dma.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace kvoffload {

namespace {

// Segments that BuildPageDma takes together, in turn: a chunk's tensors in a chunk-major
// group (the segments of one chunk follow each other and share their first block), else
// one segment. Sorting runs, not segments, keeps the host's time a copy small. A run's
// place: its first GPU block id in a chunk-major group; in a tensor-major one, where its
// copies land (the host address for a store, the GPU block id for a load).
struct DmaRun {
  int64_t group, ref, place;
  size_t first, end;
  bool operator<(const DmaRun& o) const {
    return std::tie(group, ref, place) < std::tie(o.group, o.ref, o.place);
  }
};

std::vector<DmaRun> DmaRuns(const PageLayout& layout, const int64_t* block_ids,
                            const std::vector<Segment>& segments, Direction direction) {
  std::vector<int64_t> group_of(layout.refs().size());
  for (int64_t g = 0; g < layout.groups(); ++g) {
    std::fill(group_of.begin() + layout.first_ref(g), group_of.begin() + layout.end_ref(g), g);
  }
  std::vector<DmaRun> runs;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    const int64_t g = group_of[s.ref];
    const bool chunk_major = layout.chunk_major(g);
    if (chunk_major && !runs.empty() && runs.back().group == g &&
        segments[runs.back().first].first_block == s.first_block) {
      runs.back().end = i + 1;
    } else {
      const int64_t block = block_ids[s.first_block];
      runs.push_back(chunk_major ? DmaRun{g, 0, block, i, i + 1}
                                 : DmaRun{g, s.ref, direction == Direction::kStore ? s.host : block, i, i + 1});
    }
  }
  std::stable_sort(runs.begin(), runs.end());
  return runs;
}

}  // namespace

void BuildPageDma(const PageLayout& layout, const int64_t* block_ids,
                  const std::vector<Segment>& segments, Direction direction, PageDma& out) {
  out.gpu.clear();
  out.host.clear();
  out.size.clear();
  int32_t last_ref = -1;
  for (const DmaRun& run : DmaRuns(layout, block_ids, segments, direction)) {
    for (size_t i = run.first; i < run.end; ++i) {
      const Segment& s = segments[i];
      const TensorRef& ref = layout.refs()[s.ref];
      for (int32_t k = 0; k < s.pages; ++k) {
        const UnitPlace first = PlaceUnit(ref, block_ids, s, k * UnitsPerPage(ref.page_bytes));
        const int64_t gpu = first.gpu, host = s.host + (first.job_byte - s.first_byte);
        // Pages of one tensor only: two tensors may be separate, adjacent allocations,
        // which one copy may not span.
        if (s.ref == last_ref && out.gpu.back() + out.size.back() == gpu &&
            out.host.back() + out.size.back() == host && !layout.host_break(host)) {
          out.size.back() += ref.page_bytes;
        } else {
          out.gpu.push_back(gpu);
          out.host.push_back(host);
          out.size.push_back(ref.page_bytes);
        }
        last_ref = s.ref;
      }
    }
  }
}

}  // namespace kvoffload
