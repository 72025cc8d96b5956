#include "cc/keys/job_keys.h"

#include <cstdint>

#include "cc/util/worker_pool.h"

namespace kvoffload {
namespace {

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

}  // namespace kvoffload
