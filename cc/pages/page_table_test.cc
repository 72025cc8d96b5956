// Host logic of id-addressed transfers, against a per-block reference on random layouts.

#include "cc/keys/job_keys.h"
#include "cc/pages/page_dma.h"
#include "cc/pages/page_job.h"
#include "cc/pages/page_layout.h"
#include "cc/pages/segments.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

struct RandomCase {
  std::vector<TensorRef> refs;
  std::vector<int64_t> group_refs, gpu_blocks, cpu_chunks;
  int64_t bpc = 1;
  std::vector<int64_t> block_ids, chunk_ids, group_sizes, block_indices;
};

// Appends a group's part of the job: n of its blocks and the chunks they need (when the
// group's block indices start at `first`), each distinct, at random.
void AddGroupJob(RandomCase& c, std::mt19937_64& rng, int64_t blocks, int64_t chunks, int64_t n,
                 int64_t first) {
  std::vector<int64_t> ids(blocks), chunk_ids(chunks);
  std::iota(ids.begin(), ids.end(), 0);
  std::iota(chunk_ids.begin(), chunk_ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::shuffle(chunk_ids.begin(), chunk_ids.end(), rng);
  c.block_ids.insert(c.block_ids.end(), ids.begin(), ids.begin() + n);
  c.chunk_ids.insert(c.chunk_ids.end(), chunk_ids.begin(),
                     chunk_ids.begin() + ChunksUsed(n, first, c.bpc));
  c.group_sizes.push_back(n);
  c.block_indices.push_back(first);
}

// A layout of 1-3 groups (some empty), page sizes that may not be multiples of 16 and
// may exceed a unit, chunk-major or per-tensor pools; and a job over it.
RandomCase MakeCase(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  RandomCase c;
  c.bpc = pick(1, 5);
  const int64_t groups = pick(1, 3);
  int64_t gpu_at = int64_t{1} << 40, cpu_at = int64_t{1} << 30;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t tensors = pick(0, 3), blocks = pick(0, 40), chunks = pick(1, 30);
    const bool chunk_major = pick(0, 1) == 1;
    std::vector<int64_t> pages;
    for (int64_t t = 0; t < tensors; ++t) {
      pages.push_back(pick(0, 3) == 0 ? pick(1, 3 * kPageUnitBytes) : 16 * pick(1, 300));
    }
    const int64_t chunk_bytes = c.bpc * std::accumulate(pages.begin(), pages.end(), int64_t{0});
    int64_t offset = 0;
    for (int64_t t = 0; t < tensors; ++t) {
      const int64_t stride = pages[t] + 16 * pick(0, 4);
      TensorRef r{gpu_at, stride, pages[t], 0, 0};
      gpu_at += stride * blocks + 4096;
      if (chunk_major) {
        r.cpu_base = cpu_at + offset;
        r.cpu_stride = chunk_bytes;
        offset += c.bpc * pages[t];
      } else {
        r.cpu_base = cpu_at + offset;
        r.cpu_stride = c.bpc * pages[t];
        offset += chunks * c.bpc * pages[t];
      }
      c.refs.push_back(r);
    }
    cpu_at += chunks * chunk_bytes + 4096;
    c.group_refs.push_back(tensors);
    c.gpu_blocks.push_back(blocks);
    c.cpu_chunks.push_back(chunks);
    const int64_t first = pick(0, 50);
    int64_t n = pick(0, blocks);
    while (n > 0 && ChunksUsed(n, first, c.bpc) > chunks) --n;
    AddGroupJob(c, rng, blocks, chunks, n, first);
  }
  return c;
}

PageJob JobOf(const RandomCase& c) {
  return PageJob{c.block_ids.data(),   static_cast<int64_t>(c.block_ids.size()),
                 c.chunk_ids.data(),   static_cast<int64_t>(c.chunk_ids.size()),
                 c.group_sizes.data(), c.block_indices.data(),
                 static_cast<int64_t>(c.group_sizes.size())};
}

// Per block, per tensor: (gpu address, cpu address) -> page bytes, as the planner says.
std::map<std::pair<int64_t, int64_t>, int64_t> ReferencePages(const RandomCase& c) {
  std::map<std::pair<int64_t, int64_t>, int64_t> pages;
  int64_t block_at = 0, chunk_at = 0, ref_at = 0;
  for (size_t g = 0; g < c.group_sizes.size(); ++g) {
    const int64_t skip = c.block_indices[g] % c.bpc;
    for (int64_t i = 0; i < c.group_sizes[g]; ++i) {
      const int64_t position = skip + i;
      for (int64_t r = ref_at; r < ref_at + c.group_refs[g]; ++r) {
        const TensorRef& t = c.refs[r];
        const int64_t gpu = t.gpu_base + c.block_ids[block_at + i] * t.gpu_stride;
        const int64_t cpu = t.cpu_base + c.chunk_ids[chunk_at + position / c.bpc] * t.cpu_stride +
                            (position % c.bpc) * t.page_bytes;
        pages[{gpu, cpu}] = t.page_bytes;
      }
    }
    block_at += c.group_sizes[g];
    chunk_at += ChunksUsed(c.group_sizes[g], c.block_indices[g], c.bpc);
    ref_at += c.group_refs[g];
  }
  return pages;
}

void TestUnitsMatchReference(std::mt19937_64& rng) {
  for (int trial = 0; trial < 300; ++trial) {
    const RandomCase c = MakeCase(rng);
    PageLayout layout(c.refs, c.group_refs, c.gpu_blocks, c.cpu_chunks, c.bpc);
    const PageJob job = JobOf(c);
    ValidateJob(layout, job);
    std::vector<Segment> segments;
    const int64_t units = BuildSegments(layout, job, segments);
    // Registration edges at some segments' starts: no host run may cross one.
    std::vector<int64_t> breaks;
    for (size_t k = 0; k < segments.size(); k += 3) breaks.push_back(segments[k].host);
    for (size_t k = 1; k < segments.size(); k += 3) {  // and inside segments
      if (segments[k].pages > 1) breaks.push_back(segments[k].host + layout.refs()[segments[k].ref].page_bytes);
    }
    std::sort(breaks.begin(), breaks.end());
    layout.set_host_breaks(breaks);
    std::vector<int64_t> gpu, host, size;
    UnitCopies(layout, c.block_ids.data(), segments, units, gpu, host, size);
    std::vector<std::array<int64_t, 3>> got, want;
    int64_t job_bytes = 0;
    for (int64_t u = 0; u < units; ++u) {
      got.push_back({gpu[u], host[u], size[u]});
      job_bytes += size[u];
    }
    for (const auto& [addresses, bytes] : ReferencePages(c)) {
      for (int64_t offset = 0; offset < bytes; offset += kPageUnitBytes) {
        want.push_back({addresses.first + offset, addresses.second + offset,
                        std::min(kPageUnitBytes, bytes - offset)});
      }
    }
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    EXPECT(got == want);

    // Keys: per block, its flat GPU index and its flat CPU sub-block index.
    std::vector<int64_t> gpu_offset(c.group_sizes.size()), cpu_offset(c.group_sizes.size());
    for (auto& o : gpu_offset) o = static_cast<int64_t>(rng() % 1000);
    for (auto& o : cpu_offset) o = static_cast<int64_t>(rng() % 1000);
    std::vector<int64_t> gpu_keys(c.block_ids.size(), -1), cpu_keys(c.block_ids.size(), -1);
    JobKeys(layout, job, gpu_offset.data(), cpu_offset.data(), gpu_keys.data(), cpu_keys.data());
    int64_t block_at = 0, chunk_at = 0;
    for (size_t g = 0; g < c.group_sizes.size(); ++g) {
      for (int64_t i = 0; i < c.group_sizes[g]; ++i) {
        const int64_t position = c.block_indices[g] % c.bpc + i;
        EXPECT(gpu_keys[block_at + i] == gpu_offset[g] + c.block_ids[block_at + i]);
        EXPECT(cpu_keys[block_at + i] ==
               cpu_offset[g] + c.chunk_ids[chunk_at + position / c.bpc] * c.bpc + position % c.bpc);
      }
      block_at += c.group_sizes[g];
      chunk_at += ChunksUsed(c.group_sizes[g], c.block_indices[g], c.bpc);
    }
    EXPECT(job_bytes == SegmentBytes(layout, segments));

    // Slices cover the job in order, each fitting the slot, and their host runs cover
    // exactly the job's host bytes.
    const int64_t slot = kPageUnitBytes * (1 + rng() % 4) + 256 * (rng() % 3);
    const std::vector<PageSlice> slices = CutSlices(layout, segments, units, slot);
    int64_t unit = 0, byte = 0, run_bytes = 0;
    std::vector<std::pair<int64_t, int64_t>> runs;
    for (const PageSlice& s : slices) {
      EXPECT(s.first_unit == unit && s.first_byte == byte);
      EXPECT(s.end_unit > s.first_unit && s.end_byte - s.first_byte <= slot);
      unit = s.end_unit;
      byte = s.end_byte;
      HostRuns r;
      SliceHostRuns(layout, segments, s, r);
      int64_t slot_at = 0;
      for (size_t i = 0; i < r.size.size(); ++i) {
        EXPECT(r.slot[i] == slot_at);
        slot_at += r.size[i];
        runs.push_back({r.host[i], r.size[i]});
        for (int64_t b : breaks) EXPECT(!(r.host[i] < b && b < r.host[i] + r.size[i]));
        run_bytes += r.size[i];
      }
      EXPECT(slot_at == s.end_byte - s.first_byte);
    }
    EXPECT(unit == units && byte == job_bytes && run_bytes == job_bytes);
    // Every unit's host bytes lie in the runs, at the slot offset of its job byte.
    std::sort(runs.begin(), runs.end());
    for (size_t i = 1; i < runs.size(); ++i) {
      EXPECT(runs[i - 1].first + runs[i - 1].second <= runs[i].first);  // no byte twice
    }
  }
}

// The first fault of ids[0, count) against [0, limit), each at most once, as ValidateJob
// names it; "" when there is none.
std::string ReferenceIdFault(const char* name, const int64_t* ids, int64_t count, int64_t offset,
                             int64_t limit, int64_t group) {
  std::set<int64_t> seen;
  for (int64_t i = 0; i < count; ++i) {
    const std::string at = "group " + std::to_string(group) + ": " + name + "[" +
                           std::to_string(offset + i) + "] = " + std::to_string(ids[i]);
    if (ids[i] < 0 || ids[i] >= limit) return at + " is out of range [0, " + std::to_string(limit) + ")";
    if (!seen.insert(ids[i]).second) return at + " appears twice";
  }
  return "";
}

// Jobs of more ids than one thread checks and numbers, with faults at random places:
// the same verdict, message and keys as one thread.
void TestLargeJobsAsOneThreadWould(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int faulty = 0;
  for (int trial = 0; trial < 24; ++trial) {
    RandomCase c;
    c.bpc = pick(1, 16);
    const int64_t groups = pick(1, 2);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t blocks = pick(70000, 200000), chunks = blocks / c.bpc + 2;
      c.refs.push_back(TensorRef{int64_t{1} << 40, 16, 16, int64_t{1} << 30, 16 * c.bpc});
      c.group_refs.push_back(1);
      c.gpu_blocks.push_back(blocks);
      c.cpu_chunks.push_back(chunks);
      AddGroupJob(c, rng, blocks, chunks, pick(65536, blocks), pick(0, 40));
    }
    if (trial % 2 == 0) {  // one fault of each kind in turn, in group 0's block or chunk ids
      const bool chunks = trial % 6 == 2;
      std::vector<int64_t>& ids = chunks ? c.chunk_ids : c.block_ids;
      const int64_t size = chunks ? ChunksUsed(c.group_sizes[0], c.block_indices[0], c.bpc)
                                  : c.group_sizes[0];
      switch (trial / 2 % 4) {
        case 0:
          ids[pick(0, size - 1)] = pick(INT64_MIN, -1);
          break;
        case 1:
          ids[pick(0, size - 1)] = pick(300000, INT64_MAX);
          break;
        case 2:  // far apart: marked by different threads
          ids[pick(size / 2, size - 1)] = ids[pick(0, size / 2 - 1)];
          break;
        default: {
          const int64_t i = pick(1, size - 1);
          ids[i] = ids[i - 1];
        }
      }
    }
    PageLayout layout(c.refs, c.group_refs, c.gpu_blocks, c.cpu_chunks, c.bpc);
    std::string want;
    int64_t block_at = 0, chunk_at = 0;
    for (int64_t g = 0; g < groups && want.empty(); ++g) {
      const int64_t n = c.group_sizes[g], used = ChunksUsed(n, c.block_indices[g], c.bpc);
      want = ReferenceIdFault("block_ids", c.block_ids.data() + block_at, n, block_at,
                              c.gpu_blocks[g], g);
      if (want.empty()) {
        want = ReferenceIdFault("chunk_ids", c.chunk_ids.data() + chunk_at, used, chunk_at,
                                c.cpu_chunks[g], g);
      }
      block_at += n;
      chunk_at += used;
    }
    const PageJob job = JobOf(c);
    const int threads = static_cast<int>(pick(0, 4));  // 0: the machine's
    const std::string got = InvalidArgument([&] { ValidateJob(layout, job, threads); });
    EXPECT(got == (want.empty() ? "(no exception)" : want));
    if (!want.empty()) {
      ++faulty;
      continue;
    }
    const std::vector<int64_t> gpu_offset(groups, 5), cpu_offset(groups, 9);
    std::vector<int64_t> gpu(c.block_ids.size(), -1), cpu(c.block_ids.size(), -1);
    JobKeys(layout, job, gpu_offset.data(), cpu_offset.data(), gpu.data(), cpu.data(), threads);
    block_at = chunk_at = 0;
    bool keys_ok = true;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t i = 0; i < c.group_sizes[g]; ++i) {
        const int64_t position = c.block_indices[g] % c.bpc + i;
        keys_ok = keys_ok && gpu[block_at + i] == 5 + c.block_ids[block_at + i] &&
                  cpu[block_at + i] ==
                      9 + c.chunk_ids[chunk_at + position / c.bpc] * c.bpc + position % c.bpc;
      }
      block_at += c.group_sizes[g];
      chunk_at += ChunksUsed(c.group_sizes[g], c.block_indices[g], c.bpc);
    }
    EXPECT(keys_ok);
  }
  EXPECT(faulty == 12);
}

// Few ids over a range too wide for bits covering all of it (up to 2^50 blocks): the same
// verdicts and messages, with memory in proportion to the ids.
void TestFewIdsOverAWideRange(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int faulty = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t limit = pick(int64_t{1} << 20, int64_t{1} << 50), n = pick(1, 3000);
    std::set<int64_t> distinct;
    while (static_cast<int64_t>(distinct.size()) < n) distinct.insert(pick(0, limit - 1));
    std::vector<int64_t> ids(distinct.begin(), distinct.end());
    std::shuffle(ids.begin(), ids.end(), rng);
    const int64_t size = static_cast<int64_t>(ids.size());
    switch (trial % 5) {
      case 0:
        ids[pick(0, size - 1)] = pick(INT64_MIN, -1);
        break;
      case 1:
        ids[pick(0, size - 1)] = pick(limit, INT64_MAX);
        break;
      case 2:
        if (size > 1) ids[pick(1, size - 1)] = ids[0];
        break;
      case 3:  // two faults: the first one counts
        ids[pick(0, size - 1)] = ids[pick(0, size - 1)];
        ids[pick(0, size - 1)] = limit;
        break;
      default:
        break;
    }
    RandomCase c;
    c.bpc = 1;
    c.refs.push_back(TensorRef{int64_t{1} << 40, 16, 16, int64_t{1} << 30, 16});
    c.group_refs = {1};
    c.gpu_blocks = {limit};
    c.cpu_chunks = {size};
    c.block_ids = ids;
    c.chunk_ids.resize(size);
    std::iota(c.chunk_ids.begin(), c.chunk_ids.end(), 0);
    c.group_sizes = {size};
    c.block_indices = {0};
    PageLayout layout(c.refs, c.group_refs, c.gpu_blocks, c.cpu_chunks, c.bpc);
    const std::string want = ReferenceIdFault("block_ids", ids.data(), size, 0, limit, 0);
    faulty += !want.empty();
    EXPECT(InvalidArgument([&] { ValidateJob(layout, JobOf(c)); }) ==
           (want.empty() ? "(no exception)" : want));
  }
  EXPECT(faulty >= 240);
}

void TestBadJobs() {
  const std::vector<TensorRef> refs{{1 << 20, 4096, 4096, 1 << 30, 4 * 4096}};
  const PageLayout layout(refs, {1}, {10}, {5}, 4);
  std::vector<int64_t> blocks{1, 2, 3}, chunks{0}, sizes{3}, firsts{0};
  auto job = [&] {
    return PageJob{blocks.data(), static_cast<int64_t>(blocks.size()), chunks.data(),
                   static_cast<int64_t>(chunks.size()), sizes.data(), firsts.data(), 1};
  };
  ValidateJob(layout, job());
  blocks[1] = 10;
  EXPECT(Rejects([&] { ValidateJob(layout, job()); }, "block_ids[1] = 10 is out of range"));
  blocks[1] = 1;
  EXPECT(Rejects([&] { ValidateJob(layout, job()); }, "block_ids[1] = 1 appears twice"));
  blocks[1] = 2;
  chunks[0] = -1;
  EXPECT(Rejects([&] { ValidateJob(layout, job()); }, "chunk_ids[0] = -1 is out of range"));
  chunks[0] = 0;
  firsts[0] = 2;  // 3 blocks from sub-block 2 need two chunks
  EXPECT(Rejects([&] { ValidateJob(layout, job()); }, "chunk_ids: has 1 ids but the groups use 2"));
  firsts[0] = 0;
  sizes[0] = 2;
  EXPECT(Rejects([&] { ValidateJob(layout, job()); }, "group_sizes: add up to 2"));
  // After every rejection the scratch marks are clear: a valid job passes again.
  sizes[0] = 3;
  ValidateJob(layout, job());
  EXPECT(Rejects(
      [] {
        PageLayout({{1, 1 << 20, 8, 1, 8}}, {1}, {int64_t{1} << 62}, {1}, 1);
      },
      "runs past the end of the address space"));
  EXPECT(Rejects([] { PageLayout({{1, 8, 8, 1, 8}}, {1}, {1}, {1}, 2); }, "cpu_stride"));
  // blocks_per_chunk near 2^63 (a group without chunks or tensors allows it): the counts
  // must not wrap into a job that passes with too few chunk ids.
  constexpr int64_t kHuge = INT64_MAX;
  EXPECT(Rejects([] { PageLayout({}, {0}, {4}, {0}, kHuge); },
                 "group 0: 4 blocks and blocks_per_chunk 9223372036854775807 add up past 2^63 - 1"));
  const PageLayout wide({}, {0}, {4}, {0}, kHuge - 4);
  std::vector<int64_t> two_ids = {0, 1}, no_chunks, two = {2}, near_end = {kHuge - 5};
  const PageJob spans_two{two_ids.data(), 2, no_chunks.data(), 0, two.data(), near_end.data(), 1};
  EXPECT(Rejects([&] { ValidateJob(wide, spans_two); }, "chunk_ids: has 0 ids but the groups use 2 chunks"));
  EXPECT(ChunksUsed(2, kHuge - 5, kHuge - 4) == 2 && ChunksUsed(kHuge, kHuge - 1, kHuge) == 2);
}

// Walks each DMA copy as a run of reference pages, each page used once, none across a
// host break.
void TestDmaIsThePagesMerged(std::mt19937_64& rng) {
  int64_t merged = 0;
  for (int trial = 0; trial < 300; ++trial) {
    RandomCase c = MakeCase(rng);
    if (trial % 2 == 0) {  // ascending ids: neighbours that may merge
      std::sort(c.block_ids.begin(), c.block_ids.end());
      std::sort(c.chunk_ids.begin(), c.chunk_ids.end());
    }
    PageLayout layout(c.refs, c.group_refs, c.gpu_blocks, c.cpu_chunks, c.bpc);
    const PageJob job = JobOf(c);
    if (trial % 2 == 0) {
      try {
        ValidateJob(layout, job);
      } catch (const std::invalid_argument&) {
        continue;  // sorting across groups broke the job
      }
    } else {
      ValidateJob(layout, job);
    }
    std::vector<Segment> segments;
    BuildSegments(layout, job, segments);
    std::vector<int64_t> breaks;
    for (size_t k = 1; k < segments.size(); k += 3) {
      breaks.push_back(segments[k].host + (segments[k].pages > 1 ? layout.refs()[segments[k].ref].page_bytes : 0));
    }
    std::sort(breaks.begin(), breaks.end());
    layout.set_host_breaks(breaks);
    PageDma dma;
    BuildPageDma(layout, c.block_ids.data(), segments, trial % 4 < 2 ? Direction::kStore : Direction::kLoad, dma);
    std::map<std::pair<int64_t, int64_t>, int64_t> pages = ReferencePages(c);
    EXPECT(dma.gpu.size() == dma.host.size() && dma.gpu.size() == dma.size.size());
    for (size_t i = 0; i < dma.size.size(); ++i) {
      int64_t offset = 0;
      while (offset < dma.size[i]) {
        if (offset > 0) EXPECT(!std::binary_search(breaks.begin(), breaks.end(), dma.host[i] + offset));
        auto page = pages.find({dma.gpu[i] + offset, dma.host[i] + offset});
        if (page == pages.end()) {
          EXPECT(page != pages.end());
          break;
        }
        offset += page->second;
        pages.erase(page);
      }
      EXPECT(offset == dma.size[i]);
    }
    EXPECT(pages.empty());
    merged += static_cast<int64_t>(ReferencePages(c).size()) - static_cast<int64_t>(dma.size.size());
  }
  EXPECT(merged > 0);  // some pages did merge

  // Two tensors that lie end to end on both sides stay two copies: they may be two
  // allocations.
  const int64_t page = 4096, gpu = int64_t{1} << 40, cpu = int64_t{1} << 30;
  PageLayout adjacent({TensorRef{gpu, page, page, cpu, page}, TensorRef{gpu + page, page, page, cpu + page, page}},
                      {2}, {1}, {1}, 1);
  std::vector<int64_t> block = {0}, chunk = {0}, one = {1}, first = {0};
  const PageJob job{block.data(), 1, chunk.data(), 1, one.data(), first.data(), 1};
  std::vector<Segment> segments;
  BuildSegments(adjacent, job, segments);
  PageDma dma;
  BuildPageDma(adjacent, block.data(), segments, Direction::kStore, dma);
  EXPECT(dma.size == std::vector<int64_t>({page, page}));
}

// Copies go group by group whatever the job's order: in a chunk-major group each chunk by
// the GPU block id of its first page, its tensors together and in order; in a
// tensor-major one tensor by tensor, by where they land (host address for a store, GPU
// block id for a load).
void TestDmaOrder(std::mt19937_64& rng) {
  int64_t checked = 0, several_blocks_a_chunk = 0;
  for (int trial = 0; trial < 600; ++trial) {
    RandomCase c = MakeCase(rng);
    PageLayout layout(c.refs, c.group_refs, c.gpu_blocks, c.cpu_chunks, c.bpc);
    const PageJob job = JobOf(c);
    ValidateJob(layout, job);
    // Per group, chunk id -> the block id of the chunk's first page in this job.
    std::vector<std::map<int64_t, int64_t>> first_block(layout.groups());
    int64_t block_at = 0, chunk_at = 0;
    for (int64_t g = 0; g < layout.groups(); ++g) {
      const int64_t n = c.group_sizes[g], skip = c.block_indices[g] % c.bpc;
      for (int64_t i = 0; i < n; ++i) {
        first_block[g].emplace(c.chunk_ids[chunk_at + (skip + i) / c.bpc], c.block_ids[block_at + i]);
      }
      block_at += n;
      chunk_at += ChunksUsed(n, c.block_indices[g], c.bpc);
    }
    std::vector<Segment> segments;
    BuildSegments(layout, job, segments);
    const Direction direction = trial % 2 == 0 ? Direction::kStore : Direction::kLoad;
    PageDma dma;
    BuildPageDma(layout, c.block_ids.data(), segments, direction, dma);
    std::tuple<int64_t, int64_t, int64_t, int64_t> last{-1, -1, -1, -1};
    for (size_t i = 0; i < dma.gpu.size(); ++i) {
      int64_t g = 0, r = 0;
      while (r + 1 < static_cast<int64_t>(c.refs.size()) && c.refs[r + 1].gpu_base <= dma.gpu[i]) ++r;
      while (layout.end_ref(g) <= r) ++g;
      const int64_t chunk = (dma.host[i] - c.refs[r].cpu_base) / c.refs[r].cpu_stride;
      const int64_t block = first_block[g].at(chunk);
      const auto at = layout.chunk_major(g) ? std::make_tuple(g, int64_t{0}, block, r)
                                            : std::make_tuple(g, r, direction == Direction::kStore ? dma.host[i] : block,
                                                              int64_t{0});
      EXPECT(last <= at);
      last = at;
      ++checked;
      several_blocks_a_chunk += c.bpc > 1;
    }
  }
  EXPECT(checked > 1000 && several_blocks_a_chunk > 500);
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(12345);
  kvoffload::TestUnitsMatchReference(rng);
  kvoffload::TestLargeJobsAsOneThreadWould(rng);
  kvoffload::TestFewIdsOverAWideRange(rng);
  kvoffload::TestBadJobs();
  kvoffload::TestDmaIsThePagesMerged(rng);
  kvoffload::TestDmaOrder(rng);
  return kvoffload::TestResult("page_table_test");
}
