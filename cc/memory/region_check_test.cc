// FirstCopyOutside against a per-copy scan of every interval, on random intervals (some
// adjacent, as regions of two kinds are) and copies inside, across, between and beyond
// them, with sizes up to 2^63 - 1.

#include "cc/memory/region_check.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

int64_t Pick(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

bool Inside(const std::vector<int64_t>& starts, const std::vector<int64_t>& ends, int64_t a,
            int64_t n) {
  if (n <= 0) return false;
  for (size_t j = 0; j < starts.size(); ++j) {
    if (starts[j] <= a && a < ends[j] && static_cast<__int128>(a) + n <= ends[j]) return true;
  }
  return false;
}

void MatchesTheScan(std::mt19937_64& rng) {
  int outside = 0, inside = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<int64_t> starts, ends;
    int64_t at = Pick(rng, 1, 1 << 20);
    for (int64_t k = Pick(rng, 0, 6); k > 0; --k) {
      const int64_t size = Pick(rng, 1, 1 << 16);
      starts.push_back(at);
      ends.push_back(at + size);
      at += size + (Pick(rng, 0, 2) == 0 ? 0 : Pick(rng, 1, 1 << 12));  // adjacent or apart
    }
    if (Pick(rng, 0, 9) == 0 && !starts.empty()) ends.back() = kMax;
    std::vector<int64_t> addresses, sizes;
    for (int64_t i = Pick(rng, 0, 8); i > 0; --i) {
      if (starts.empty() || Pick(rng, 0, 29) == 0) {
        const int64_t odd[] = {0, -1, kMin, kMax, Pick(rng, kMin, kMax)};
        addresses.push_back(odd[Pick(rng, 0, 4)]);
        sizes.push_back(Pick(rng, 0, 1) ? Pick(rng, kMin, kMax) : Pick(rng, -2, 64));
        continue;
      }
      const size_t j = Pick(rng, 0, starts.size() - 1);
      const int64_t edges[] = {starts[j], starts[j] - 1, ends[j] - 1, ends[j],
                               Pick(rng, starts[j] - 8, std::min(ends[j] - 1, starts[j] + (1 << 17)))};
      const int64_t a = edges[Pick(rng, 0, 3) == 0 ? Pick(rng, 0, 3) : 4];
      const int64_t room = ends[j] - a;
      const int64_t n = Pick(rng, 0, 7) == 0 ? Pick(rng, room - 2, room + 2) : Pick(rng, 1, 4096);
      addresses.push_back(a);
      sizes.push_back(Pick(rng, 0, 59) == 0 ? kMax : n);
    }
    int64_t want = -1;
    for (size_t i = 0; i < addresses.size() && want < 0; ++i) {
      if (!Inside(starts, ends, addresses[i], sizes[i])) want = static_cast<int64_t>(i);
    }
    const int64_t got = FirstCopyOutside(starts.data(), ends.data(), starts.size(), addresses.data(),
                                         sizes.data(), addresses.size());
    EXPECT(got == want);
    (want < 0 ? inside : outside) += 1;
  }
  EXPECT(inside > 300 && outside > 300);
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(424242);
  kvoffload::MatchesTheScan(rng);
  return kvoffload::TestResult("region_check_test");
}
