// The recycler hands a freed array to the next taker large enough, keeps no more than
// its bound, and never gives one array to two holders.

#include "cc/util/recycled_buffer.h"

#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

constexpr size_t kBig = BufferRecycler::kMinBytes / sizeof(int64_t);

void ReusesFreedMemory() {
  const int64_t* first;
  {
    RecycledBuffer a(2 * kBig);
    first = a.data();
  }
  RecycledBuffer b(2 * kBig - 5);  // smaller: the kept array fits
  EXPECT(b.data() == first);
  RecycledBuffer c(2 * kBig);  // the kept one is taken: a new array
  EXPECT(c.data() != first);
}

void ASmallArrayNeverHoldsALargeOne() {
  const int64_t* large;
  {
    RecycledBuffer a(64 * kBig);
    large = a.data();
  }
  RecycledBuffer small(5 * kBig);  // larger than any other kept array; the 64x one is too large
  EXPECT(small.data() != large);
  RecycledBuffer half(32 * kBig);  // half its size: takes it
  EXPECT(half.data() == large);
}

void MovedFromBuffersAreEmpty() {
  RecycledBuffer a(3 * kBig);
  const int64_t* data = a.data();
  RecycledBuffer b(std::move(a));
  EXPECT(b.data() == data && b.size() == 3 * kBig);
  EXPECT(a.data() == nullptr && a.size() == 0);  // NOLINT(bugprone-use-after-move)
  RecycledBuffer c;
  c = std::move(b);
  EXPECT(c.data() == data && b.data() == nullptr && b.size() == 0);  // NOLINT(bugprone-use-after-move)
}

void CopiesValues() {
  std::mt19937_64 rng(7);
  for (size_t size : {size_t{0}, size_t{3}, kBig, 3 * kBig + 1}) {
    std::vector<int64_t> values(size);
    for (auto& v : values) v = static_cast<int64_t>(rng());
    RecycledBuffer buffer(values.data(), values.size());
    EXPECT(buffer.size() == size);
    EXPECT(std::vector<int64_t>(buffer.data(), buffer.data() + size) == values);
  }
}

void LiveBuffersNeverShareMemory() {
  std::mt19937_64 rng(11);
  std::vector<RecycledBuffer> live;
  for (int step = 0; step < 2000; ++step) {
    if (!live.empty() && rng() % 2) {
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
    } else {
      live.emplace_back(static_cast<size_t>(rng() % (4 * kBig)));
    }
    std::set<const int64_t*> seen;
    for (const RecycledBuffer& b : live) EXPECT(seen.insert(b.data()).second);
    EXPECT(BufferRecycler::Instance().kept_bytes() <= BufferRecycler::kKeptBytes);
  }
}

void KeepsNoMoreThanItsBound() {
  const size_t huge = BufferRecycler::kKeptBytes / sizeof(int64_t) / 3;
  {
    std::vector<RecycledBuffer> many;
    for (int i = 0; i < 8; ++i) many.emplace_back(huge);
  }
  EXPECT(BufferRecycler::Instance().kept_bytes() <= BufferRecycler::kKeptBytes);
  EXPECT(BufferRecycler::Instance().kept_bytes() >= 2 * huge * sizeof(int64_t));
}

}  // namespace
}  // namespace kvoffload

int main() {
  kvoffload::ReusesFreedMemory();
  kvoffload::ASmallArrayNeverHoldsALargeOne();
  kvoffload::MovedFromBuffersAreEmpty();
  kvoffload::CopiesValues();
  kvoffload::LiveBuffersNeverShareMemory();
  kvoffload::KeepsNoMoreThanItsBound();
  return kvoffload::TestResult("recycled_buffer_test");
}
