#ifndef KVOFFLOAD_CC_PAGES_SEGMENTS_H_
#define KVOFFLOAD_CC_PAGES_SEGMENTS_H_

// A checked job cut into segments (a tensor's pages in one chunk), in the order their
// bytes are staged; the segments cut into staging-ring slices and their host runs; and
// every unit's copy, the reference the GPU's addresses are tested against.

#include <cstdint>
#include <vector>

#include "cc/pages/page_job.h"
#include "cc/pages/page_layout.h"

namespace kvoffload {

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

// The reference: every unit's (GPU address, host address, bytes), in unit order.
void UnitCopies(const PageLayout& layout, const int64_t* block_ids,
                const std::vector<Segment>& segments, int64_t total_units,
                std::vector<int64_t>& gpu, std::vector<int64_t>& host, std::vector<int64_t>& size);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_PAGES_SEGMENTS_H_
