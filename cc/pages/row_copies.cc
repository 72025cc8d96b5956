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
                    Direction direction, int64_t rows_per_copy, RowCopies& out, PageDma& pages,
                    std::vector<Segment>& rest) {
  out.gpu.clear();
  out.host.clear();
  out.width.clear();
  out.rows.clear();
  out.group.clear();
  rest.clear();
  std::vector<int64_t> group_of(layout.refs().size());
  for (int64_t g = 0; g < layout.groups(); ++g) {
    std::fill(group_of.begin() + layout.first_ref(g), group_of.begin() + layout.end_ref(g), g);
  }
  const bool banded = rows_per_copy > 0;
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
      blocks[g].push_back({direction == Direction::kStore && !banded ? host : gpu, gpu, host});
    }
  }
  std::vector<Block> runs;  // blocks merged: place holds the width
  for (int64_t g = 0; g < layout.groups(); ++g) {
    if (blocks[g].empty()) continue;
    std::sort(blocks[g].begin(), blocks[g].end());
    const GroupRows& r = rows[g];
    const int64_t page = layout.refs()[layout.first_ref(g)].page_bytes;
    const int64_t widest = std::min(r.gpu_pitch, r.host_pitch);
    runs.clear();
    for (const Block& b : blocks[g]) {
      if (!runs.empty() && runs.back().gpu + runs.back().place == b.gpu &&
          runs.back().host + runs.back().place == b.host && runs.back().place + page <= widest) {
        runs.back().place += page;
      } else {
        runs.push_back({page, b.gpu, b.host});
      }
    }
    const int64_t band = banded ? std::min(rows_per_copy, r.rows) : r.rows;
    for (int64_t first_row = 0; first_row < r.rows; first_row += band) {
      const int64_t n = std::min(band, r.rows - first_row);
      for (const Block& run : runs) {
        const int64_t gpu = run.gpu + first_row * r.gpu_pitch, host = run.host + first_row * r.host_pitch;
        // Host rows that would cross into another registration go one row at a time, cut
        // at the breaks (a copy may not span two registrations).
        if (layout.next_host_break(host) >= host + (n - 1) * r.host_pitch + run.place) {
          out.gpu.push_back(gpu);
          out.host.push_back(host);
          out.width.push_back(run.place);
          out.rows.push_back(n);
          out.group.push_back(g);
          continue;
        }
        for (int64_t row = 0; row < n; ++row) {
          int64_t row_gpu = gpu + row * r.gpu_pitch, row_host = host + row * r.host_pitch;
          for (int64_t left = run.place; left > 0;) {
            const int64_t bytes = std::min(left, layout.next_host_break(row_host) - row_host);
            pages.gpu.push_back(row_gpu);
            pages.host.push_back(row_host);
            pages.size.push_back(bytes);
            row_gpu += bytes;
            row_host += bytes;
            left -= bytes;
          }
        }
      }
    }
  }
}

}  // namespace kvoffload
