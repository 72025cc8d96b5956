// Strided DMA's plan against the per-page reference, byte by byte, on random layouts of
// one allocation a group (as vLLM's LBHNC), with host breaks, runs of consecutive ids and
// groups that are not strided beside them.

#include "cc/pages/row_copies.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "cc/pages/page_dma.h"
#include "cc/pages/page_job.h"
#include "cc/pages/page_layout.h"
#include "cc/pages/segments.h"
#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

struct Case {
  std::vector<TensorRef> refs;
  std::vector<int64_t> group_refs, gpu_blocks, cpu_chunks;
  int64_t bpc = 1;
  std::vector<int64_t> block_ids, chunk_ids, group_sizes, block_indices;
  std::vector<bool> strided;  // by construction
};

// Ids of n distinct blocks out of `count`: shuffled, or runs of consecutive ids in
// shuffled order (as a block pool hands them out).
std::vector<int64_t> Ids(std::mt19937_64& rng, int64_t count, int64_t n, bool runs) {
  std::vector<int64_t> ids(count);
  std::iota(ids.begin(), ids.end(), 0);
  if (runs) {
    const int64_t run = std::uniform_int_distribution<int64_t>(2, 6)(rng);
    std::vector<std::vector<int64_t>> pieces;
    for (int64_t i = 0; i < count; i += run) {
      pieces.emplace_back(ids.begin() + i, ids.begin() + std::min(count, i + run));
    }
    std::shuffle(pieces.begin(), pieces.end(), rng);
    ids.clear();
    for (const auto& p : pieces) ids.insert(ids.end(), p.begin(), p.end());
  } else {
    std::shuffle(ids.begin(), ids.end(), rng);
  }
  ids.resize(n);
  return ids;
}

Case MakeCase(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Case c;
  c.bpc = pick(1, 4);
  int64_t gpu_at = int64_t{1} << 40, cpu_at = int64_t{1} << 30;
  for (int64_t g = 0, groups = pick(1, 3); g < groups; ++g) {
    const int64_t tensors = pick(1, 5), blocks = pick(1, 30), chunks = pick(1, 20);
    const int64_t page = 16 * pick(1, 20), stride = page + 16 * pick(0, 1) * pick(0, 3);
    const bool chunk_major = pick(0, 1) == 1;
    const int64_t kind = pick(0, 3);  // 1: the last tensor off the constant distance; else on it
    const int64_t gpu_pitch = stride * blocks + 16 * pick(0, 8);
    for (int64_t t = 0; t < tensors; ++t) {
      TensorRef r{gpu_at + t * gpu_pitch + (kind == 1 && t == tensors - 1 ? 32 : 0), stride, page,
                  0, 0};
      if (chunk_major) {
        r.cpu_base = cpu_at + t * c.bpc * page;
        r.cpu_stride = tensors * c.bpc * page;
      } else {
        r.cpu_stride = c.bpc * page + 16 * pick(0, 1);
        r.cpu_base = cpu_at + t * (r.cpu_stride * chunks + 16 * pick(0, 1));
      }
      c.refs.push_back(r);
    }
    gpu_at += gpu_pitch * tensors + 4096;
    cpu_at += (chunks + 1) * tensors * (c.bpc * page + 16) + 4096;
    c.group_refs.push_back(tensors);
    c.gpu_blocks.push_back(blocks);
    c.cpu_chunks.push_back(chunks);
    const int64_t first = pick(0, 9);
    int64_t n = pick(0, blocks);
    while (n > 0 && ChunksUsed(n, first, c.bpc) > chunks) --n;
    const std::vector<int64_t> ids = Ids(rng, blocks, n, pick(0, 1) == 1);
    // Chunks in order, often: runs then continue on the host side too.
    std::vector<int64_t> chunk_ids = Ids(rng, chunks, ChunksUsed(n, first, c.bpc), pick(0, 1) == 1);
    if (pick(0, 1) == 1) std::sort(chunk_ids.begin(), chunk_ids.end());
    c.block_ids.insert(c.block_ids.end(), ids.begin(), ids.end());
    c.chunk_ids.insert(c.chunk_ids.end(), chunk_ids.begin(), chunk_ids.end());
    c.group_sizes.push_back(n);
    c.block_indices.push_back(first);
  }
  return c;
}

PageJob JobOf(const Case& c) {
  return PageJob{c.block_ids.data(),   static_cast<int64_t>(c.block_ids.size()),
                 c.chunk_ids.data(),   static_cast<int64_t>(c.chunk_ids.size()),
                 c.group_sizes.data(), c.block_indices.data(),
                 static_cast<int64_t>(c.group_sizes.size())};
}

// GPU byte -> host byte, for every byte the copies move; a byte moved twice fails.
void Expand(int64_t gpu, int64_t host, int64_t bytes, std::map<int64_t, int64_t>& out) {
  for (int64_t b = 0; b < bytes; ++b) EXPECT(out.emplace(gpu + b, host + b).second);
}

void TestRowsMoveThePages(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int64_t row_copies = 0, merged = 0, cut = 0, rest = 0, banded = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const Case c = MakeCase(rng);
    PageLayout layout(c.refs, c.group_refs, c.gpu_blocks, c.cpu_chunks, c.bpc);
    const PageJob job = JobOf(c);
    ValidateJob(layout, job);
    std::vector<Segment> segments;
    const int64_t units = BuildSegments(layout, job, segments);
    // Registration edges at some segments' starts and inside some pages: no copy may span one.
    std::vector<int64_t> breaks;
    for (size_t k = 0; k < segments.size(); k += 7) breaks.push_back(segments[k].host);
    for (size_t k = 3; k < segments.size(); k += 11) {
      breaks.push_back(segments[k].host + 16 * pick(1, layout.refs()[segments[k].ref].page_bytes / 16));
    }
    std::sort(breaks.begin(), breaks.end());
    layout.set_host_breaks(breaks);
    std::vector<GroupRows> rows;
    for (int64_t g = 0; g < layout.groups(); ++g) rows.push_back(GroupRowsOf(layout, g));

    std::vector<int64_t> gpu, host, size;
    UnitCopies(layout, c.block_ids.data(), segments, units, gpu, host, size);
    std::map<int64_t, int64_t> want, got;
    for (size_t u = 0; u < gpu.size(); ++u) Expand(gpu[u], host[u], size[u], want);

    const Direction direction = trial % 2 ? Direction::kStore : Direction::kLoad;
    RowCopies copies;
    PageDma pages, others;
    std::vector<Segment> left;
    // All rows a copy, or bands of 1 to 6 rows.
    const int64_t rows_per_copy = trial % 3 == 0 ? 0 : pick(1, 6);
    BuildRowCopies(layout, rows, c.block_ids.data(), segments, direction, rows_per_copy, copies, pages,
                   left);
    BuildPageDma(layout, c.block_ids.data(), left, direction, others);
    for (size_t i = 0; i < others.gpu.size(); ++i) Expand(others.gpu[i], others.host[i], others.size[i], got);
    for (size_t i = 0; i < pages.gpu.size(); ++i) {
      EXPECT(layout.next_host_break(pages.host[i]) >= pages.host[i] + pages.size[i]);
      Expand(pages.gpu[i], pages.host[i], pages.size[i], got);
    }
    cut += static_cast<int64_t>(pages.gpu.size());
    rest += static_cast<int64_t>(left.size());
    for (size_t i = 0; i < copies.gpu.size(); ++i) {
      const GroupRows& r = rows[copies.group[i]];
      EXPECT(r.strided);
      const int64_t page = layout.refs()[layout.first_ref(copies.group[i])].page_bytes;
      EXPECT(copies.width[i] % page == 0 && copies.width[i] <= r.gpu_pitch &&
             copies.width[i] <= r.host_pitch);
      EXPECT(copies.rows[i] >= 1 && copies.rows[i] <= r.rows);
      EXPECT(rows_per_copy == 0 ? copies.rows[i] == r.rows : copies.rows[i] <= rows_per_copy);
      EXPECT(layout.next_host_break(copies.host[i]) >=
             copies.host[i] + (copies.rows[i] - 1) * r.host_pitch + copies.width[i]);
      merged += copies.width[i] > page;
      banded += copies.rows[i] < r.rows;
      for (int64_t row = 0; row < copies.rows[i]; ++row) {
        Expand(copies.gpu[i] + row * r.gpu_pitch, copies.host[i] + row * r.host_pitch,
               copies.width[i], got);
      }
    }
    // Banded, each group's copies go band by band and by GPU address within a band.
    for (size_t i = 1; rows_per_copy > 0 && i < copies.gpu.size(); ++i) {
      if (copies.group[i] != copies.group[i - 1]) continue;
      const GroupRows& r = rows[copies.group[i]];
      const int64_t base = layout.refs()[layout.first_ref(copies.group[i])].gpu_base;
      auto band = [&](size_t k) { return (copies.gpu[k] - base) / r.gpu_pitch / rows_per_copy; };
      EXPECT(band(i) > band(i - 1) || (band(i) == band(i - 1) && copies.gpu[i] > copies.gpu[i - 1]));
    }
    row_copies += static_cast<int64_t>(copies.gpu.size());
    EXPECT(got == want);
    // Groups that are not strided keep all their segments for per-page DMA.
    for (const Segment& s : left) {
      int64_t g = 0;
      while (layout.end_ref(g) <= s.ref) ++g;
      EXPECT(!rows[g].strided);
    }
  }
  // The cases reach every branch.
  EXPECT(row_copies > 500 && merged > 50 && cut > 20 && rest > 50 && banded > 100);
}

void TestWhyNot() {
  auto layout_of = [](std::vector<TensorRef> refs) {
    const int64_t n = static_cast<int64_t>(refs.size());
    return PageLayout(std::move(refs), {n}, {4}, {4}, 1);
  };
  const int64_t p = 256;
  // Two tensors, a constant distance apart on both sides.
  GroupRows r = GroupRowsOf(layout_of({{1 << 20, p, p, 1 << 30, p}, {(1 << 20) + 4 * p, p, p, (1 << 30) + 8 * p, p}}), 0);
  EXPECT(r.strided && r.rows == 2 && r.gpu_pitch == 4 * p && r.host_pitch == 8 * p);
  EXPECT(GroupRowsOf(layout_of({{1 << 20, p, p, 1 << 30, p}}), 0).why_not == "one tensor");
  r = GroupRowsOf(layout_of({{1 << 20, p, p, 1 << 30, p},
                             {(1 << 20) + 4 * p, p, p, (1 << 30) + 4 * p, p},
                             {(1 << 20) + 9 * p, p, p, (1 << 30) + 8 * p, p}}),
                  0);
  EXPECT(!r.strided && r.why_not == "tensors are not a constant distance apart");
  r = GroupRowsOf(layout_of({{(1 << 20) + 4 * p, p, p, 1 << 30, p}, {1 << 20, p, p, (1 << 30) + 4 * p, p}}), 0);
  EXPECT(!r.strided && r.why_not == "tensors overlap or run backwards");
  r = GroupRowsOf(layout_of({{1 << 20, p, p, 1 << 30, p}, {(1 << 20) + 4 * p, 2 * p, p, (1 << 30) + 4 * p, p}}), 0);
  EXPECT(!r.strided && r.why_not == "tensors differ in page size or stride");
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(54321);
  kvoffload::TestRowsMoveThePages(rng);
  kvoffload::TestWhyNot();
  return kvoffload::failures == 0 ? 0 : 1;
}
