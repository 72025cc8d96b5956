#ifndef KVOFFLOAD_CC_PAGES_PAGE_ADDRESS_H_
#define KVOFFLOAD_CC_PAGES_PAGE_ADDRESS_H_

// The per-page arithmetic of a KV transfer, shared by the host reference and the GPU
// kernels (which see it as __host__ __device__).

#include <cstdint>

#ifdef __CUDACC__
#define KVOFFLOAD_HOST_DEVICE __host__ __device__
#else
#define KVOFFLOAD_HOST_DEVICE
#endif

namespace kvoffload {

// Kernels split pages into units of at most this many bytes, one warp per unit.
constexpr int64_t kPageUnitBytes = int64_t{32} << 10;

// One tensor of one KV-cache group, in bytes: GPU block b starts at
// gpu_base + b * gpu_stride; sub-block j of CPU chunk c at
// cpu_base + c * cpu_stride + j * page_bytes.
struct TensorRef {
  int64_t gpu_base;
  int64_t gpu_stride;
  int64_t page_bytes;
  int64_t cpu_base;
  int64_t cpu_stride;
};

// `pages` consecutive sub-blocks of one tensor in one chunk: one run on the host side.
struct Segment {
  int64_t host;         // host address of its first page
  int64_t first_block;  // index into the job's block ids of its first page
  int64_t first_unit;   // units of the job before it
  int64_t first_byte;   // bytes of the job before it
  int32_t ref;          // index into the layout's TensorRefs
  int32_t pages;
};

KVOFFLOAD_HOST_DEVICE inline int64_t UnitsPerPage(int64_t page_bytes) {
  return (page_bytes + kPageUnitBytes - 1) / kPageUnitBytes;
}

// Where unit `unit` of segment `s` (unit counted from the segment's first) moves:
// its GPU address, its byte offset in the job, and its size.
struct UnitPlace {
  int64_t gpu;
  int64_t job_byte;
  int64_t bytes;
};

KVOFFLOAD_HOST_DEVICE inline UnitPlace PlaceUnit(const TensorRef& ref, const int64_t* block_ids,
                                                 const Segment& s, int64_t unit) {
  const int64_t per_page = UnitsPerPage(ref.page_bytes);
  const int64_t page = unit / per_page;
  const int64_t offset = (unit % per_page) * kPageUnitBytes;
  const int64_t rest = ref.page_bytes - offset;
  UnitPlace p;
  p.gpu = ref.gpu_base + block_ids[s.first_block + page] * ref.gpu_stride + offset;
  p.job_byte = s.first_byte + page * ref.page_bytes + offset;
  p.bytes = rest < kPageUnitBytes ? rest : kPageUnitBytes;
  return p;
}

// The segment holding unit `unit` of the job: the last one whose first_unit <= unit.
KVOFFLOAD_HOST_DEVICE inline int64_t FindSegment(const Segment* segments, int64_t count,
                                                 int64_t unit) {
  int64_t lo = 0, hi = count;  // segments[lo].first_unit <= unit < segments[hi].first_unit
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (segments[mid].first_unit <= unit) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_PAGES_PAGE_ADDRESS_H_
