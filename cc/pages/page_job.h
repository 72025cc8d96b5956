#ifndef KVOFFLOAD_CC_PAGES_PAGE_JOB_H_
#define KVOFFLOAD_CC_PAGES_PAGE_JOB_H_

// One job of the page table, as ids (GPU block ids and CPU chunk ids, by group), and its
// check against a PageLayout: counts that add up, ids in range, none twice in a group.
// Host work grows with chunks times tensors, not with pages.

#include <cstdint>
#include <string>

#include "cc/pages/page_layout.h"

namespace kvoffload {

// Below this many ids (or keys), one thread checks (or numbers) them.
constexpr int64_t kThreadedIds = int64_t{1} << 16;

// What ValidateJob's messages call a job's arrays: the caller's names for them.
struct JobNames {
  std::string block_ids = "block_ids";
  std::string chunk_ids = "chunk_ids";
  std::string group_sizes = "group_sizes";
  std::string block_indices = "block_indices";
};

// One job: group g has group_sizes[g] blocks whose first logical index is
// block_indices[g]; block ids and chunk ids are concatenated by group. Borrowed arrays.
struct PageJob {
  const int64_t* block_ids = nullptr;
  int64_t num_block_ids = 0;
  const int64_t* chunk_ids = nullptr;
  int64_t num_chunk_ids = 0;
  const int64_t* group_sizes = nullptr;
  const int64_t* block_indices = nullptr;
  int64_t groups = 0;
  const JobNames* names = nullptr;  // null: JobNames{}
};

// Chunks a group of `blocks` blocks whose first logical index is `first_index` touches.
int64_t ChunksUsed(int64_t blocks, int64_t first_index, int64_t blocks_per_chunk);

// Throws std::invalid_argument naming the group and index at fault: counts that do not
// add up, ids out of range, an id used twice in a group. max_threads: as for SlicesFor
// (cc/util/worker_pool.h).
void ValidateJob(const PageLayout& layout, const PageJob& job, int max_threads = 0);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_PAGES_PAGE_JOB_H_
