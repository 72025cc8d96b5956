#include "cc/pages/row_copies.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace kvoffload {

GroupRows GroupRowsOf(const PageLayout& layout, int64_t g) {
  GroupRows out;
  const int64_t first = layout.first_ref(g), end = layout.end_ref(g);
  out.rows = end - first;
  if (out.rows < 2) {
    out.why_not = out.rows == 0 ? "no tensors" : "one tensor";
    return out;
  }
  const TensorRef& a = layout.refs()[first];
  const TensorRef& b = layout.refs()[first + 1];
  out.gpu_pitch = b.gpu_base - a.gpu_base;
  out.host_pitch = b.cpu_base - a.cpu_base;
  if (out.gpu_pitch < a.page_bytes || out.host_pitch < a.page_bytes) {
    out.why_not = "tensors overlap or run backwards";
    return out;
  }
  for (int64_t r = first; r < end; ++r) {
    const TensorRef& t = layout.refs()[r];
    const int64_t k = r - first;
    if (t.page_bytes != a.page_bytes || t.gpu_stride != a.gpu_stride ||
        t.cpu_stride != a.cpu_stride) {
      out.why_not = "tensors differ in page size or stride";
      return out;
    }
    if (t.gpu_base != a.gpu_base + k * out.gpu_pitch ||
        t.cpu_base != a.cpu_base + k * out.host_pitch) {
      out.why_not = "tensors are not a constant distance apart";
      return out;
    }
  }
  out.strided = true;
  return out;
}

namespace {

struct Block {
  int64_t place, gpu, host;
  bool operator<(const Block& o) const { return place < o.place; }
};

}  // namespace

void BuildRowCopies(const PageLayout& layout, const std::vector<GroupRows>& rows,
                    const int64_t* block_ids, const std::vector<Segment>& segments,
                    Direction direction, RowCopies& out, PageDma& pages,
                    std::vector<Segment>& rest) {
  out.gpu.clear();
  out.host.clear();
  out.width.clear();
  out.group.clear();
  rest.clear();
  std::vector<int64_t> group_of(layout.refs().size());
  for (int64_t g = 0; g < layout.groups(); ++g) {
    std::fill(group_of.begin() + layout.first_ref(g), group_of.begin() + layout.end_ref(g), g);
  }
  std::vector<std::vector<Block>> blocks(layout.groups());
  for (const Segment& s : segments) {
    const int64_t g = group_of[s.ref];
    if (!rows[g].strided) {
      rest.push_back(s);
      continue;
    }
    if (s.ref != layout.first_ref(g)) continue;  // the first tensor's pages name the rows
    const TensorRef& t = layout.refs()[s.ref];
    for (int32_t k = 0; k < s.pages; ++k) {
      const int64_t gpu = t.gpu_base + block_ids[s.first_block + k] * t.gpu_stride;
      const int64_t host = s.host + k * t.page_bytes;
      blocks[g].push_back({direction == Direction::kStore ? host : gpu, gpu, host});
    }
  }
  for (int64_t g = 0; g < layout.groups(); ++g) {
    if (blocks[g].empty()) continue;
    std::sort(blocks[g].begin(), blocks[g].end());
    const GroupRows& r = rows[g];
    const int64_t page = layout.refs()[layout.first_ref(g)].page_bytes;
    const int64_t widest = std::min(r.gpu_pitch, r.host_pitch);
    const size_t first_copy = out.gpu.size();
    for (const Block& b : blocks[g]) {
      const size_t n = out.gpu.size();
      if (n > first_copy && out.gpu[n - 1] + out.width[n - 1] == b.gpu &&
          out.host[n - 1] + out.width[n - 1] == b.host && out.width[n - 1] + page <= widest) {
        out.width[n - 1] += page;
      } else {
        out.gpu.push_back(b.gpu);
        out.host.push_back(b.host);
        out.width.push_back(page);
        out.group.push_back(g);
      }
    }
    // Host rows that would cross into another registration go one row at a time, cut at
    // the breaks (a copy may not span two registrations).
    size_t kept = first_copy;
    for (size_t i = first_copy; i < out.gpu.size(); ++i) {
      const int64_t host_end = out.host[i] + (r.rows - 1) * r.host_pitch + out.width[i];
      if (layout.next_host_break(out.host[i]) >= host_end) {
        out.gpu[kept] = out.gpu[i];
        out.host[kept] = out.host[i];
        out.width[kept] = out.width[i];
        out.group[kept] = out.group[i];
        ++kept;
        continue;
      }
      for (int64_t row = 0; row < r.rows; ++row) {
        int64_t gpu = out.gpu[i] + row * r.gpu_pitch, host = out.host[i] + row * r.host_pitch;
        for (int64_t left = out.width[i]; left > 0;) {
          const int64_t bytes = std::min(left, layout.next_host_break(host) - host);
          pages.gpu.push_back(gpu);
          pages.host.push_back(host);
          pages.size.push_back(bytes);
          gpu += bytes;
          host += bytes;
          left -= bytes;
        }
      }
    }
    out.gpu.resize(kept);
    out.host.resize(kept);
    out.width.resize(kept);
    out.group.resize(kept);
  }
}

}  // namespace kvoffload
