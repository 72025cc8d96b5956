#include "cc/memory/region_check.h"

#include <algorithm>

namespace kvoffload {

int64_t FirstCopyOutside(const int64_t* starts, const int64_t* ends, int64_t intervals,
                         const int64_t* addresses, const int64_t* sizes, int64_t count) {
  int64_t j = 0;  // the interval that held the previous copy
  for (int64_t i = 0; i < count; ++i) {
    const int64_t a = addresses[i], n = sizes[i];
    if (intervals == 0 || n <= 0) return i;
    if (!(starts[j] <= a && a < ends[j])) {
      j = std::upper_bound(starts, starts + intervals, a) - starts - 1;
      if (j < 0) return i;
    }
    // ends[j] - a >= n, not a + n <= ends[j]: the sum may overflow int64.
    if (a >= ends[j] || ends[j] - a < n) return i;
  }
  return -1;
}

}  // namespace kvoffload
