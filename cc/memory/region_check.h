#ifndef KVOFFLOAD_CC_MEMORY_REGION_CHECK_H_
#define KVOFFLOAD_CC_MEMORY_REGION_CHECK_H_

// Copies checked against registered memory, as kvoffload.copy.registry merges it: sorted,
// disjoint intervals [starts[j], ends[j]).

#include <cstdint>

namespace kvoffload {

// The index of the first copy [addresses[i], addresses[i] + sizes[i]) that is empty or
// does not lie inside one interval, or -1 when every copy does. One pass; the interval
// of the previous copy is tried first. Nothing wraps: a copy's end is never computed.
int64_t FirstCopyOutside(const int64_t* starts, const int64_t* ends, int64_t intervals,
                         const int64_t* addresses, const int64_t* sizes, int64_t count);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_MEMORY_REGION_CHECK_H_
