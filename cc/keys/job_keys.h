#ifndef KVOFFLOAD_CC_KEYS_JOB_KEYS_H_
#define KVOFFLOAD_CC_KEYS_JOB_KEYS_H_

// The keys of a job's blocks, which the handler's conflict tracking (key_tables.h,
// kvoffload.jobs.accesses) records per lane.

#include <cstdint>

#include "cc/pages/page_job.h"
#include "cc/pages/page_layout.h"

namespace kvoffload {

// Where a (validated) job's bytes lie, for conflict tracking: per block, its index in a
// flat numbering of every GPU block, gpu_offset[g] + block id, and of every CPU
// sub-block, cpu_offset[g] + chunk id * blocks_per_chunk + sub-block. Groups that share
// tensors share an offset. gpu and cpu hold job.num_block_ids keys each.
void JobKeys(const PageLayout& layout, const PageJob& job, const int64_t* gpu_offset,
             const int64_t* cpu_offset, int64_t* gpu, int64_t* cpu, int max_threads = 0);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_KEYS_JOB_KEYS_H_
