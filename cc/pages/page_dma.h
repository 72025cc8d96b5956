#ifndef KVOFFLOAD_CC_PAGES_PAGE_DMA_H_
#define KVOFFLOAD_CC_PAGES_PAGE_DMA_H_

// A job's segments as plain DMA copies: the runs of pages a copy engine moves, merged
// where pages follow each other on both sides. Used by page_copy's DMA path.

#include <cstdint>
#include <vector>

#include "cc/copy/direction.h"
#include "cc/pages/page_layout.h"

namespace kvoffload {

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

#endif  // KVOFFLOAD_CC_PAGES_PAGE_DMA_H_
