#ifndef KVOFFLOAD_CC_PAGES_PAGE_LAYOUT_H_
#define KVOFFLOAD_CC_PAGES_PAGE_LAYOUT_H_

// The page table's layout: KV transfers are named by ids, as vLLM's offload worker names
// them, over every group's tensors and the CPU pool's geometry, uploaded once. Jobs are
// checked by ValidateJob (page_job.h) and cut into segments (segments.h); the GPU computes
// every page's addresses (page_address.h). Used by the extension's PageTable and by
// page_copy, row_copies and job_keys.

#include <cstdint>
#include <vector>

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

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_PAGES_PAGE_LAYOUT_H_
