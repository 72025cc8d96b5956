#include "cc/pages/page_table.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cc/util/worker_pool.h"

namespace kvoffload {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

[[noreturn]] void Reject(const std::string& what) { throw std::invalid_argument(what); }

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

// Below this many ids (or keys), one thread checks (or numbers) them.
constexpr int64_t kThreadedIds = int64_t{1} << 16;

// The index of the first id outside [0, limit) or equal to an earlier one, or `count` when
// there is none. seen: scratch bits, all clear on entry and exit.
int64_t FirstIdFault(const int64_t* ids, int64_t count, int64_t limit, std::vector<uint64_t>& seen) {
  const int64_t words = limit / 64 + 1;
  int64_t i = 0;
  if (words > 8 * count + 1024) {
    // Few ids over a wide range: bits for all of it could be more memory than there is;
    // sorting the ids costs memory in proportion to them.
    while (i < count && static_cast<uint64_t>(ids[i]) < static_cast<uint64_t>(limit)) ++i;
    std::vector<std::pair<int64_t, int64_t>> sorted(i);  // (id, index)
    for (int64_t k = 0; k < i; ++k) sorted[k] = {ids[k], k};
    std::sort(sorted.begin(), sorted.end());
    for (size_t k = 1; k < sorted.size(); ++k) {
      if (sorted[k].first == sorted[k - 1].first) i = std::min(i, sorted[k].second);
    }
    return i;
  }
  if (static_cast<int64_t>(seen.size()) < words) seen.resize(words, 0);
  for (; i < count; ++i) {
    const uint64_t id = static_cast<uint64_t>(ids[i]);  // negative ids become huge
    if (id >= static_cast<uint64_t>(limit)) break;
    uint64_t& word = seen[id >> 6];
    const uint64_t bit = uint64_t{1} << (id & 63);
    if (word & bit) break;
    word |= bit;
  }
  // Clearing by id touches i words; clearing all of them is cheaper past that.
  if (i < words / 8) {
    for (int64_t k = 0; k < i; ++k) seen[static_cast<uint64_t>(ids[k]) >> 6] = 0;
  } else {
    std::fill(seen.begin(), seen.begin() + words, 0);
  }
  return i;
}

// Ids in [0, limit), each at most once; else throws naming the first id at fault.
void CheckIds(const char* name, const int64_t* ids, int64_t count, int64_t offset, int64_t limit,
              int64_t group, std::vector<uint64_t>& seen) {
  const int64_t i = FirstIdFault(ids, count, limit, seen);
  if (i == count) return;
  const std::string at = std::string(name) + "[" + Str(offset + i) + "] = " + Str(ids[i]);
  if (ids[i] < 0 || ids[i] >= limit) {
    Reject("group " + Str(group) + ": " + at + " is out of range [0, " + Str(limit) + ")");
  }
  Reject("group " + Str(group) + ": " + at + " appears twice");
}

// Whether the ids are in [0, limit), each at most once, on several threads: each marks
// its share of the ids in bits of its own, then checks and clears a range of every
// slice's bits (an id that two slices marked appears twice). seen: as for CheckIds.
bool IdsAreValid(const int64_t* ids, int64_t count, int64_t limit, std::vector<uint64_t>& seen,
                 int max_threads) {
  const int slices = SlicesFor(count, kThreadedIds, max_threads);
  const int64_t words = limit / 64 + 1;
  if (static_cast<int64_t>(seen.size()) < slices * words) seen.resize(slices * words, 0);
  std::array<bool, kMaxSlices> valid;
  valid.fill(true);
  auto mark = [&](int s) {
    uint64_t* mine = seen.data() + s * words;
    const auto [begin, end] = SliceOf(count, slices, s);
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t id = static_cast<uint64_t>(ids[i]);  // negative ids become huge
      const uint64_t bit = uint64_t{1} << (id & 63);
      if (id >= static_cast<uint64_t>(limit) || (mine[id >> 6] & bit)) {
        valid[s] = false;
        break;
      }
      mine[id >> 6] |= bit;
    }
  };
  try {
    RunSlices(slices, mark);
  } catch (...) {  // making the pool (std::bad_alloc), before any slice ran: keep seen clear
    std::fill(seen.begin(), seen.begin() + slices * words, 0);
    throw;
  }
  RunSlices(slices, [&](int s) {
    const auto [begin, end] = SliceOf(words, slices, s);
    for (int64_t w = begin; w < end; ++w) {
      uint64_t marked = 0;
      for (int t = 0; t < slices; ++t) {
        uint64_t& word = seen[t * words + w];
        if (marked & word) valid[s] = false;
        marked |= word;
        word = 0;
      }
    }
  });
  return std::all_of(valid.begin(), valid.begin() + slices, [](bool v) { return v; });
}

// CheckIds, on several threads when there are many ids, dense enough in [0, limit) that
// every thread's bits cost little (then on one again to name the id at fault).
void CheckManyIds(const char* name, const int64_t* ids, int64_t count, int64_t offset,
                  int64_t limit, int64_t group, std::vector<uint64_t>& seen, int max_threads) {
  const bool threaded = count >= kThreadedIds && limit / 64 <= count;
  if (threaded && IdsAreValid(ids, count, limit, seen, max_threads)) return;
  CheckIds(name, ids, count, offset, limit, group, seen);
}

// JobKeys for blocks [begin, end) of one group: gpu[i] = gpu_base + block[i]; cpu[i] is
// the CPU sub-block of the group's block i, whose chunks start `skip` sub-blocks in.
void GroupKeys(const int64_t* block, const int64_t* chunk, int64_t skip, int64_t bpc,
               int64_t gpu_base, int64_t cpu_base, int64_t begin, int64_t end, int64_t* gpu,
               int64_t* cpu) {
  for (int64_t i = begin; i < end; ++i) gpu[i] = gpu_base + block[i];
  int64_t k = (skip + begin) / bpc, sub = (skip + begin) % bpc;
  for (int64_t i = begin; i < end; ++k, sub = 0) {
    const int64_t first = cpu_base + chunk[k] * bpc + sub;
    const int64_t count = std::min(bpc - sub, end - i);
    for (int64_t s = 0; s < count; ++s) cpu[i + s] = first + s;
    i += count;
  }
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
    Reject("gpu_blocks, cpu_chunks: need one entry per group (" + Str(groups) + ")");
  }
  if (blocks_per_chunk < 1) Reject("blocks_per_chunk: must be >= 1, got " + Str(blocks_per_chunk));
  first_ref_.push_back(0);
  for (size_t g = 0; g < groups; ++g) {
    if (group_refs[g] < 0) Reject("group_refs[" + Str(g) + "]: must be >= 0");
    if (gpu_blocks_[g] < 0 || cpu_chunks_[g] < 0) {
      Reject("group " + Str(g) + ": block and chunk counts must be >= 0");
    }
    // A block's place among its chunks' sub-blocks is below blocks_per_chunk + its count.
    if (gpu_blocks_[g] > INT64_MAX - blocks_per_chunk) {
      Reject("group " + Str(g) + ": " + Str(gpu_blocks_[g]) + " blocks and blocks_per_chunk " +
             Str(blocks_per_chunk) + " add up past 2^63 - 1");
    }
    first_ref_.push_back(first_ref_.back() + group_refs[g]);
  }
  if (first_ref_.back() != static_cast<int64_t>(refs_.size())) {
    Reject("refs: has " + Str(refs_.size()) + " entries but group_refs add up to " +
           Str(first_ref_.back()));
  }
  for (size_t g = 0; g < groups; ++g) {
    bool chunk_major = true;
    int64_t chunk_offset = 0;
    for (int64_t r = first_ref_[g]; r < first_ref_[g + 1]; ++r) {
      const TensorRef& t = refs_[r];
      const std::string name = "group " + Str(g) + " tensor " + Str(r - first_ref_[g]);
      if (t.page_bytes < 1) Reject(name + ": page_bytes must be >= 1");
      if ((gpu_blocks_[g] > 0 && t.gpu_base < 1) || (cpu_chunks_[g] > 0 && t.cpu_base < 1)) {
        Reject(name + ": base addresses must be > 0");
      }
      if (t.gpu_stride < t.page_bytes) Reject(name + ": gpu_stride is smaller than the page");
      int64_t chunk_bytes = 0;
      if (__builtin_mul_overflow(blocks_per_chunk, t.page_bytes, &chunk_bytes) ||
          t.cpu_stride < chunk_bytes) {
        Reject(name + ": cpu_stride cannot hold " + Str(blocks_per_chunk) + " pages");
      }
      const int64_t gpu_end = ExtentEnd(t.gpu_base, t.gpu_stride, t.page_bytes, gpu_blocks_[g]);
      const int64_t cpu_end = ExtentEnd(t.cpu_base, t.cpu_stride, chunk_bytes, cpu_chunks_[g]);
      if (gpu_end < 0 || cpu_end < 0) {
        Reject(name + ": its extent runs past the end of the address space");
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

int64_t ChunksUsed(int64_t blocks, int64_t first_index, int64_t blocks_per_chunk) {
  if (blocks == 0) return 0;
  // In 128 bits: with blocks_per_chunk near 2^63 the sum passes it (the quotient never does).
  const __int128 skip = first_index % blocks_per_chunk;
  return static_cast<int64_t>((blocks + skip + blocks_per_chunk - 1) / blocks_per_chunk);
}

void ValidateJob(const PageLayout& layout, const PageJob& job, int max_threads) {
  static const JobNames kNames;
  const JobNames& name = job.names != nullptr ? *job.names : kNames;
  if (job.groups != layout.groups()) {
    Reject(name.group_sizes + ": has " + Str(job.groups) + " groups but the layout has " +
           Str(layout.groups()));
  }
  int64_t blocks = 0, chunks = 0;
  for (int64_t g = 0; g < job.groups; ++g) {
    const int64_t n = job.group_sizes[g], first = job.block_indices[g];
    if (n < 0) Reject(name.group_sizes + "[" + Str(g) + "]: must be >= 0, got " + Str(n));
    if (first < 0) Reject(name.block_indices + "[" + Str(g) + "]: must be >= 0, got " + Str(first));
    if (n > job.num_block_ids) {
      Reject(name.group_sizes + "[" + Str(g) + "]: " + Str(n) + " exceeds the block ids given");
    }
    blocks += n;
    if (blocks > job.num_block_ids) break;
    chunks += ChunksUsed(n, first, layout.blocks_per_chunk());
  }
  if (blocks != job.num_block_ids) {
    Reject(name.group_sizes + ": add up to " + Str(blocks) + " but " + name.block_ids + " has " +
           Str(job.num_block_ids) + " ids");
  }
  if (chunks != job.num_chunk_ids) {
    std::string each;
    for (int64_t g = 0; g < job.groups; ++g) {
      each += (g ? ", " : "") + Str(ChunksUsed(job.group_sizes[g], job.block_indices[g],
                                               layout.blocks_per_chunk()));
    }
    Reject(name.chunk_ids + ": has " + Str(job.num_chunk_ids) + " ids but the groups use " +
           Str(chunks) + " chunks (" + each + ")");
  }
  thread_local std::vector<uint64_t> seen;
  int64_t block_at = 0, chunk_at = 0;
  for (int64_t g = 0; g < job.groups; ++g) {
    const int64_t n = job.group_sizes[g];
    const int64_t used = ChunksUsed(n, job.block_indices[g], layout.blocks_per_chunk());
    CheckManyIds(name.block_ids.c_str(), job.block_ids + block_at, n, block_at, layout.gpu_blocks(g), g,
                 seen, max_threads);
    CheckManyIds(name.chunk_ids.c_str(), job.chunk_ids + chunk_at, used, chunk_at, layout.cpu_chunks(g), g,
                 seen, max_threads);
    block_at += n;
    chunk_at += used;
  }
}

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

void JobKeys(const PageLayout& layout, const PageJob& job, const int64_t* gpu_offset,
             const int64_t* cpu_offset, int64_t* gpu, int64_t* cpu, int max_threads) {
  const int64_t bpc = layout.blocks_per_chunk();
  int64_t block_at = 0, chunk_at = 0;
  for (int64_t g = 0; g < job.groups; ++g) {
    const int64_t n = job.group_sizes[g];
    const int slices = SlicesFor(n, kThreadedIds, max_threads);
    RunSlices(slices, [&](int s) {
      const SliceBounds bounds = SliceOf(n, slices, s);
      GroupKeys(job.block_ids + block_at, job.chunk_ids + chunk_at, job.block_indices[g] % bpc,
                bpc, gpu_offset[g], cpu_offset[g], bounds.begin, bounds.end, gpu + block_at,
                cpu + block_at);
    });
    block_at += n;
    chunk_at += ChunksUsed(n, job.block_indices[g], bpc);
  }
}

int64_t SegmentBytes(const PageLayout& layout, const std::vector<Segment>& segments) {
  if (segments.empty()) return 0;
  const Segment& last = segments.back();
  return last.first_byte + last.pages * layout.refs()[last.ref].page_bytes;
}

std::vector<PageSlice> CutSlices(const PageLayout& layout, const std::vector<Segment>& segments,
                                 int64_t total_units, int64_t slot_bytes) {
  if (slot_bytes < kPageUnitBytes) {
    Reject("slot_bytes: must be >= " + Str(kPageUnitBytes) + ", got " + Str(slot_bytes));
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
