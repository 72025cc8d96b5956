// Key tables against a one-key-at-a-time reference, on random tables and keys below and
// above the threading threshold, on 1-4 threads or the default, with keys outside the
// table at random places.

#include "cc/keys/key_tables.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

struct Case {
  std::vector<int64_t> values, keys;
  KeyedTable table() {
    return {values.data(), static_cast<int64_t>(values.size()), keys.data(),
            static_cast<int64_t>(keys.size())};
  }
};

int64_t Pick(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// A key count on either side of the threshold (or of a thread count's), a table of as
// many or more values from a narrow or a wide range, and keys distinct or not; maybe some
// keys outside the table.
Case MakeCase(std::mt19937_64& rng, bool bad) {
  const int64_t counts[] = {0, 1, Pick(rng, 2, 1000), kThreadedKeys - 1, kThreadedKeys,
                            kThreadedKeys * 3 / 2 + 1, Pick(rng, 2 * kThreadedKeys - 3, 300000)};
  const int64_t count = counts[Pick(rng, 0, 6)];
  Case c;
  c.values.resize(count + Pick(rng, 0, count > 0 ? 3 * count : 5));
  const bool narrow = Pick(rng, 0, 1) == 1;
  for (int64_t& v : c.values) v = narrow ? Pick(rng, 0, 63) : Pick(rng, kMin, kMax);
  const int64_t size = static_cast<int64_t>(c.values.size());
  if (Pick(rng, 0, 1)) {
    std::vector<int64_t> all(size);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    c.keys.assign(all.begin(), all.begin() + count);
  } else {
    for (int64_t i = 0; i < count; ++i) c.keys.push_back(Pick(rng, 0, size - 1));
  }
  for (int64_t n = bad && count > 0 ? Pick(rng, 1, 3) : 0; n > 0; --n) {
    const int64_t outside[] = {-1, size, kMin, kMax, Pick(rng, kMin, -1), Pick(rng, size, kMax)};
    c.keys[Pick(rng, 0, count - 1)] = outside[Pick(rng, 0, 5)];
  }
  return c;
}

// max_threads: 0 (the default) or 1-4.
int Threads(std::mt19937_64& rng) { return static_cast<int>(Pick(rng, 0, 4)); }

int64_t RefFirstOutside(const Case& c) {
  for (size_t i = 0; i < c.keys.size(); ++i) {
    if (c.keys[i] < 0 || c.keys[i] >= static_cast<int64_t>(c.values.size())) return i;
  }
  return -1;
}

std::string RefMessage(const Case& c) {
  const int64_t i = RefFirstOutside(c);
  return "keys[" + std::to_string(i) + "] = " + std::to_string(c.keys[i]) +
         " is outside the table of " + std::to_string(c.values.size());
}

template <typename F>
std::string OutOfRange(F f) {
  return MessageOf<std::out_of_range>(f);
}

void FindsTheFirstKeyOutside(std::mt19937_64& rng) {
  for (int n = 0; n < 150; ++n) {
    Case c = MakeCase(rng, n % 2 == 0);
    EXPECT(FirstKeyOutside(c.table(), Threads(rng)) == RefFirstOutside(c));
  }
}

void FillsBothTablesOrNeither(std::mt19937_64& rng) {
  int filled = 0, refused_a = 0, refused_b = 0;
  for (int n = 0; n < 150; ++n) {
    Case a = MakeCase(rng, Pick(rng, 0, 3) == 0), b = MakeCase(rng, Pick(rng, 0, 3) == 0);
    const int64_t value = Pick(rng, kMin, kMax);
    const int threads = Threads(rng);
    Case want_a = a, want_b = b;
    std::string want = "(no exception)";
    if (RefFirstOutside(a) >= 0) {
      want = RefMessage(a);
      ++refused_a;
    } else if (RefFirstOutside(b) >= 0) {
      want = RefMessage(b);
      ++refused_b;
    } else {
      for (int64_t k : a.keys) want_a.values[k] = value;
      for (int64_t k : b.keys) want_b.values[k] = value;
      ++filled;
    }
    EXPECT(OutOfRange([&] { FillTables(a.table(), b.table(), value, threads); }) == want);
    EXPECT(a.values == want_a.values && b.values == want_b.values);
  }
  Case one = MakeCase(rng, false);
  Case want = one;
  for (int64_t k : one.keys) want.values[k] = 7;
  FillTables(one.table(), {}, 7, Threads(rng));
  EXPECT(one.values == want.values);
  EXPECT(filled > 10 && refused_a > 5 && refused_b > 3);
}

void FindsTheDistinctValuesSince(std::mt19937_64& rng) {
  for (int n = 0; n < 200; ++n) {
    Case c = MakeCase(rng, Pick(rng, 0, 3) == 0);
    const int64_t since = c.values.empty() || Pick(rng, 0, 4) == 0
                              ? Pick(rng, kMin, kMax)
                              : c.values[Pick(rng, 0, c.values.size() - 1)];
    const int threads = Threads(rng);
    std::vector<int64_t> got;
    const std::string error = OutOfRange([&] { got = ValuesSince(c.table(), since, threads); });
    if (RefFirstOutside(c) >= 0) {
      EXPECT(error == RefMessage(c));
      continue;
    }
    std::set<int64_t> want;
    for (int64_t k : c.keys) {
      if (c.values[k] >= since) want.insert(c.values[k]);
    }
    EXPECT(error == "(no exception)");
    EXPECT(got == std::vector<int64_t>(want.begin(), want.end()));
  }
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(20240611);
  kvoffload::FindsTheFirstKeyOutside(rng);
  kvoffload::FillsBothTablesOrNeither(rng);
  kvoffload::FindsTheDistinctValuesSince(rng);
  return kvoffload::TestResult("key_tables_test");
}
