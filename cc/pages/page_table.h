#ifndef KVOFFLOAD_CC_PAGES_PAGE_TABLE_H_
#define KVOFFLOAD_CC_PAGES_PAGE_TABLE_H_

// KV transfers named by ids, as vLLM's offload worker names them: a layout of every
// group's tensors, uploaded once, and per job the GPU block ids and CPU chunk ids. The
// host checks the ids and cuts the job into segments (a tensor's pages in one chunk);
// the GPU computes every page's addresses (cc/page_address.h). Host work grows with
// chunks times tensors, not with pages.

#include <cstdint>
#include <string>
#include <vector>

#include "cc/copy/direction.h"
#include "cc/pages/page_address.h"

namespace kvoffload {

// Every group's tensors and the CPU pool's geometry, validated at construction.
class PageLayout {
 public:
  // refs: every group's tensors, group after group; group_refs[g]: how many refs group g
  // has; gpu_blocks[g], cpu_chunks[g]: its block and chunk counts.
  PageLayout(std::vector<TensorRef> refs, const std::vector<int64_t>& group_refs,
             std::vector<int64_t> gpu_blocks, std::vector<int64_t> cpu_chunks,
             int64_t blocks_per_chunk);

  const std::vector<TensorRef>& refs() const { return refs_; }
  int64_t groups() const { return static_cast<int64_t>(gpu_blocks_.size()); }
  int64_t first_ref(int64_t g) const { return first_ref_[g]; }
  int64_t end_ref(int64_t g) const { return first_ref_[g + 1]; }
  int64_t gpu_blocks(int64_t g) const { return gpu_blocks_[g]; }
  int64_t cpu_chunks(int64_t g) const { return cpu_chunks_[g]; }
  int64_t blocks_per_chunk() const { return blocks_per_chunk_; }
  // Whether a chunk of group g holds its tensors' sub-blocks one after another (a
  // chunk-major pool): the job's segments then go chunk by chunk, else tensor by tensor.
  bool chunk_major(int64_t g) const { return chunk_major_[g] != 0; }
  // Bytes from ref r's base to the end of its last block (GPU) or chunk (CPU).
  int64_t gpu_span(int64_t r) const { return gpu_span_[r]; }
  int64_t cpu_span(int64_t r) const { return cpu_span_[r]; }
  // Host addresses where one page-locked registration ends and another begins (a DMA
  // may not span two: cuMemcpyBatchAsync rejects such a copy). Host runs are not merged
  // across them.
  void set_host_breaks(std::vector<int64_t> breaks);
  bool host_break(int64_t address) const;
  // The first break after `address`; INT64_MAX if none.
  int64_t next_host_break(int64_t address) const;

 private:
  std::vector<TensorRef> refs_;
  std::vector<int64_t> first_ref_;
  std::vector<int64_t> gpu_blocks_, cpu_chunks_;
  std::vector<uint8_t> chunk_major_;
  std::vector<int64_t> gpu_span_, cpu_span_;
  std::vector<int64_t> host_breaks_;  // sorted
  int64_t blocks_per_chunk_;
};

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
// (cc/worker_pool.h).
void ValidateJob(const PageLayout& layout, const PageJob& job, int max_threads = 0);

// The job's segments, in the order their bytes are staged; returns the job's units.
// The job must have passed ValidateJob.
int64_t BuildSegments(const PageLayout& layout, const PageJob& job, std::vector<Segment>& out);

// Bytes in segments (the sum of their pages' bytes).
int64_t SegmentBytes(const PageLayout& layout, const std::vector<Segment>& segments);

// A slice of the job that fits one staging slot: units [first_unit, end_unit), which
// are the job's bytes [first_byte, end_byte).
struct PageSlice {
  int64_t first_unit, end_unit;
  int64_t first_byte, end_byte;
};

// Cuts the job into slices of at most slot_bytes (>= kPageUnitBytes), at unit edges.
std::vector<PageSlice> CutSlices(const PageLayout& layout, const std::vector<Segment>& segments,
                                 int64_t total_units, int64_t slot_bytes);

// The host runs of a slice: run i is bytes [slot[i], slot[i] + size[i]) of the slot and
// [host[i], host[i] + size[i]) of the host. Adjacent runs are merged.
struct HostRuns {
  std::vector<int64_t> host, slot, size;
};
void SliceHostRuns(const PageLayout& layout, const std::vector<Segment>& segments,
                   const PageSlice& slice, HostRuns& out);

// Where a (validated) job's bytes lie, for conflict tracking: per block, its index in a
// flat numbering of every GPU block, gpu_offset[g] + block id, and of every CPU
// sub-block, cpu_offset[g] + chunk id * blocks_per_chunk + sub-block. Groups that share
// tensors share an offset. gpu and cpu hold job.num_block_ids keys each.
void JobKeys(const PageLayout& layout, const PageJob& job, const int64_t* gpu_offset,
             const int64_t* cpu_offset, int64_t* gpu, int64_t* cpu, int max_threads = 0);

// The reference: every unit's (GPU address, host address, bytes), in unit order.
void UnitCopies(const PageLayout& layout, const int64_t* block_ids,
                const std::vector<Segment>& segments, int64_t total_units,
                std::vector<int64_t>& gpu, std::vector<int64_t>& host, std::vector<int64_t>& size);

// The job as plain DMA: copy i moves size[i] bytes between gpu[i] and host[i]; one copy
// per page, pages that follow each other on both sides merged, never across a host break.
// Segments go group by group: in a chunk-major group chunk by chunk, by the GPU block id
// of its first page, a chunk's tensors together; in a tensor-major one tensor by tensor,
// in the order of where they land (host address for a store, GPU block id for a load).
// Beside a model a copy engine's rate falls with the span of memory its copies touch
// (docs/studies.md#dma-address-spread).
struct PageDma {
  std::vector<int64_t> gpu, host, size;
};
void BuildPageDma(const PageLayout& layout, const int64_t* block_ids,
                  const std::vector<Segment>& segments, Direction direction, PageDma& out);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_PAGES_PAGE_TABLE_H_
