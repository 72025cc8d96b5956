#include "cc/pages/page_job.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/util/worker_pool.h"

namespace kvoffload {
namespace {

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
  const std::string at = std::string(name) + "[" + std::to_string(offset + i) + "] = " + std::to_string(ids[i]);
  if (ids[i] < 0 || ids[i] >= limit) {
    throw std::invalid_argument("group " + std::to_string(group) + ": " + at + " is out of range [0, " + std::to_string(limit) + ")");
  }
  throw std::invalid_argument("group " + std::to_string(group) + ": " + at + " appears twice");
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

}  // namespace

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
    throw std::invalid_argument(name.group_sizes + ": has " + std::to_string(job.groups) + " groups but the layout has " +
           std::to_string(layout.groups()));
  }
  int64_t blocks = 0, chunks = 0;
  for (int64_t g = 0; g < job.groups; ++g) {
    const int64_t n = job.group_sizes[g], first = job.block_indices[g];
    if (n < 0) throw std::invalid_argument(name.group_sizes + "[" + std::to_string(g) + "]: must be >= 0, got " + std::to_string(n));
    if (first < 0) throw std::invalid_argument(name.block_indices + "[" + std::to_string(g) + "]: must be >= 0, got " + std::to_string(first));
    if (n > job.num_block_ids) {
      throw std::invalid_argument(name.group_sizes + "[" + std::to_string(g) + "]: " + std::to_string(n) + " exceeds the block ids given");
    }
    blocks += n;
    if (blocks > job.num_block_ids) break;
    chunks += ChunksUsed(n, first, layout.blocks_per_chunk());
  }
  if (blocks != job.num_block_ids) {
    throw std::invalid_argument(name.group_sizes + ": add up to " + std::to_string(blocks) + " but " + name.block_ids + " has " +
           std::to_string(job.num_block_ids) + " ids");
  }
  if (chunks != job.num_chunk_ids) {
    std::string each;
    for (int64_t g = 0; g < job.groups; ++g) {
      each += (g ? ", " : "") + std::to_string(ChunksUsed(job.group_sizes[g], job.block_indices[g],
                                               layout.blocks_per_chunk()));
    }
    throw std::invalid_argument(name.chunk_ids + ": has " + std::to_string(job.num_chunk_ids) + " ids but the groups use " +
           std::to_string(chunks) + " chunks (" + each + ")");
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

}  // namespace kvoffload
