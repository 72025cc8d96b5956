#include "cc/pages/segments.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvoffload {

int64_t BuildSegments(const PageLayout& layout, const PageJob& job, std::vector<Segment>& out) {
  out.clear();
  const int64_t bpc = layout.blocks_per_chunk();
  const std::vector<TensorRef>& refs = layout.refs();
  int64_t units = 0, bytes = 0, block_at = 0, chunk_at = 0;
  auto add = [&](int64_t r, int64_t chunk, int64_t first_sub, int64_t pages, int64_t block) {
    const TensorRef& t = refs[r];
    out.push_back(Segment{t.cpu_base + chunk * t.cpu_stride + first_sub * t.page_bytes, block,
                          units, bytes, static_cast<int32_t>(r), static_cast<int32_t>(pages)});
    units += pages * UnitsPerPage(t.page_bytes);
    bytes += pages * t.page_bytes;
  };
  for (int64_t g = 0; g < layout.groups(); ++g) {
    const int64_t n = job.group_sizes[g];
    const int64_t skip = job.block_indices[g] % bpc;
    const int64_t used = ChunksUsed(n, job.block_indices[g], bpc);
    // Chunk k holds the group's blocks [k * bpc - skip, (k + 1) * bpc - skip), clipped.
    auto first_sub = [&](int64_t k) { return k == 0 ? skip : 0; };
    auto end_sub = [&](int64_t k) { return std::min(bpc, skip + n - k * bpc); };
    const int64_t first_ref = layout.first_ref(g), end_ref = layout.end_ref(g);
    if (layout.chunk_major(g)) {
      for (int64_t k = 0; k < used; ++k) {
        for (int64_t r = first_ref; r < end_ref; ++r) {
          add(r, job.chunk_ids[chunk_at + k], first_sub(k), end_sub(k) - first_sub(k),
              block_at + k * bpc + first_sub(k) - skip);
        }
      }
    } else {
      for (int64_t r = first_ref; r < end_ref; ++r) {
        for (int64_t k = 0; k < used; ++k) {
          add(r, job.chunk_ids[chunk_at + k], first_sub(k), end_sub(k) - first_sub(k),
              block_at + k * bpc + first_sub(k) - skip);
        }
      }
    }
    block_at += n;
    chunk_at += used;
  }
  return units;
}

int64_t SegmentBytes(const PageLayout& layout, const std::vector<Segment>& segments) {
  if (segments.empty()) return 0;
  const Segment& last = segments.back();
  return last.first_byte + last.pages * layout.refs()[last.ref].page_bytes;
}

std::vector<PageSlice> CutSlices(const PageLayout& layout, const std::vector<Segment>& segments,
                                 int64_t total_units, int64_t slot_bytes) {
  if (slot_bytes < kPageUnitBytes) {
    throw std::invalid_argument("slot_bytes: must be >= " + std::to_string(kPageUnitBytes) + ", got " + std::to_string(slot_bytes));
  }
  std::vector<PageSlice> slices;
  const int64_t total_bytes = SegmentBytes(layout, segments);
  int64_t unit = 0, byte = 0;
  size_t s = 0;
  while (unit < total_units) {
    const int64_t limit = byte + slot_bytes;
    PageSlice slice{unit, total_units, byte, total_bytes};
    // The first segment that ends past the limit holds the cut.
    while (s < segments.size()) {
      const TensorRef& t = layout.refs()[segments[s].ref];
      const Segment& seg = segments[s];
      if (seg.first_byte + seg.pages * t.page_bytes <= limit) {
        ++s;
        continue;
      }
      if (seg.first_byte >= limit) {
        slice.end_unit = seg.first_unit;
        slice.end_byte = seg.first_byte;
        break;
      }
      const int64_t into = limit - seg.first_byte;
      const int64_t page = into / t.page_bytes;
      const int64_t piece = (into % t.page_bytes) / kPageUnitBytes;
      slice.end_unit = seg.first_unit + page * UnitsPerPage(t.page_bytes) + piece;
      slice.end_byte = seg.first_byte + page * t.page_bytes + piece * kPageUnitBytes;
      break;
    }
    slices.push_back(slice);
    unit = slice.end_unit;
    byte = slice.end_byte;
  }
  return slices;
}

void SliceHostRuns(const PageLayout& layout, const std::vector<Segment>& segments,
                   const PageSlice& slice, HostRuns& out) {
  out.host.clear();
  out.slot.clear();
  out.size.clear();
  int64_t s = FindSegment(segments.data(), static_cast<int64_t>(segments.size()), slice.first_unit);
  for (; s < static_cast<int64_t>(segments.size()); ++s) {
    const Segment& seg = segments[s];
    const int64_t end = seg.first_byte + seg.pages * layout.refs()[seg.ref].page_bytes;
    const int64_t from = std::max(seg.first_byte, slice.first_byte);
    const int64_t to = std::min(end, slice.end_byte);
    if (from >= slice.end_byte) break;
    if (to <= from) continue;
    int64_t host = seg.host + (from - seg.first_byte);
    for (int64_t at = from; at < to;) {  // a run ends at every break, inside a segment too
      const int64_t bytes = std::min(to - at, layout.next_host_break(host) - host);
      if (!out.size.empty() && out.host.back() + out.size.back() == host &&
          !layout.host_break(host)) {
        out.size.back() += bytes;
      } else {
        out.host.push_back(host);
        out.slot.push_back(at - slice.first_byte);
        out.size.push_back(bytes);
      }
      at += bytes;
      host += bytes;
    }
  }
}

void UnitCopies(const PageLayout& layout, const int64_t* block_ids,
                const std::vector<Segment>& segments, int64_t total_units,
                std::vector<int64_t>& gpu, std::vector<int64_t>& host, std::vector<int64_t>& size) {
  gpu.resize(total_units);
  host.resize(total_units);
  size.resize(total_units);
  for (int64_t u = 0; u < total_units; ++u) {
    const Segment& seg =
        segments[FindSegment(segments.data(), static_cast<int64_t>(segments.size()), u)];
    const UnitPlace p = PlaceUnit(layout.refs()[seg.ref], block_ids, seg, u - seg.first_unit);
    gpu[u] = p.gpu;
    host[u] = seg.host + (p.job_byte - seg.first_byte);
    size[u] = p.bytes;
  }
}

}  // namespace kvoffload
