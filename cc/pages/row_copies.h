#ifndef KVOFFLOAD_CC_PAGES_ROW_COPIES_H_
#define KVOFFLOAD_CC_PAGES_ROW_COPIES_H_

// Strided DMA: where a group's tensors lie a constant distance apart on both sides (every
// layer of vLLM's one allocation under LBHNC, and a tensor-major host pool), one 2D copy
// moves a block, or a run of blocks that follow each other on both sides, across all of
// them: its rows are the tensors.

#include <cstdint>
#include <string>
#include <vector>

#include "cc/copy/direction.h"
#include "cc/pages/page_dma.h"
#include "cc/pages/page_layout.h"
#include "cc/pages/segments.h"

namespace kvoffload {

// Whether group g's tensors can be rows of one copy, as far as addresses tell: two or
// more tensors with one page size, one GPU stride and one CPU stride, whose bases are a
// constant, positive distance apart on each side. Whether the rows lie in one allocation
// is the memory's question (DevicePageTable asks the driver).
struct GroupRows {
  bool strided = false;
  std::string why_not;  // when not strided
  int64_t rows = 0;
  int64_t gpu_pitch = 0;
  int64_t host_pitch = 0;
};

GroupRows GroupRowsOf(const PageLayout& layout, int64_t g);

// Copy i moves width[i] bytes in each of rows[i] rows of its group: row r between
// gpu[i] + r * gpu_pitch and host[i] + r * host_pitch.
struct RowCopies {
  std::vector<int64_t> gpu, host, width, rows, group;
};

// Splits a validated job's segments (BuildSegments) between 2D copies and per-page DMA.
// The pages of every group with rows[g].strided become row copies, blocks merged while
// they follow each other on both sides and a row stays within its pitch, in the order of
// where they land (host address for a store, GPU address for a load). With
// rows_per_copy > 0 a copy spans at most that many rows: each group's copies go band of
// rows by band, by GPU address within one, so the copies in flight touch fewer GPU pages at a
// time (docs/studies.md#strided-dma-beside-a-model). A copy whose host
// rows would cross a host break goes row by row, cut at the breaks, appended to `pages`;
// the segments of the other groups go to `rest`, for BuildPageDma.
void BuildRowCopies(const PageLayout& layout, const std::vector<GroupRows>& rows,
                    const int64_t* block_ids, const std::vector<Segment>& segments,
                    Direction direction, int64_t rows_per_copy, RowCopies& out, PageDma& pages,
                    std::vector<Segment>& rest);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_PAGES_ROW_COPIES_H_
