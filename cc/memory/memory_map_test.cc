// MemoryMap against a fake driver on random layouts: every answer matches what the driver
// says of the address, and the driver is asked once per allocation or unranged page.

#include "cc/memory/memory_map.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

constexpr int64_t kPage = 4096;

// A range of addresses and what the fake driver says of it. Ranged ones are allocations
// (the driver names their range); the others it answers page by page.
struct Region {
  int64_t start, end;
  MemoryKind kind;
  int ordinal;
  bool ranged;
};

struct FakeDriver {
  std::vector<Region> regions;  // sorted, disjoint; gaps are unknown
  int64_t calls = 0;
  bool wrong_range = false;  // unranged answers carry a range that misses the address

  const Region* Find(int64_t address) const {
    for (const Region& r : regions) {
      if (r.start <= address && address < r.end) return &r;
    }
    return nullptr;
  }
  PointerAttributes Ask(int64_t address) {
    ++calls;
    const Region* r = Find(address);
    if (r == nullptr) return {};
    PointerAttributes a{r->kind, r->ordinal, 0, 0};
    if (r->ranged) {
      a.range_start = r->start;
      a.range_size = r->end - r->start;
    } else if (wrong_range) {
      a.range_start = address + 1;
      a.range_size = 1 << 20;
    }
    return a;
  }
  MemoryMap Map() {
    return MemoryMap([this](int64_t address) { return Ask(address); });
  }
};

// What At must answer, and the range the driver is asked about once.
std::pair<Memory, int64_t> Expected(const FakeDriver& d, int64_t address) {
  const Region* r = d.Find(address);
  if (r != nullptr && r->ranged) return {Memory{r->end, r->kind, r->ordinal}, r->start};
  const int64_t page = address / kPage * kPage;
  const Memory m{page + kPage, r ? r->kind : MemoryKind::kUnknown, r ? r->ordinal : -1};
  return {m, page};
}

bool Same(const Memory& a, const Memory& b) {
  return a.end == b.end && a.kind == b.kind && a.ordinal == b.ordinal;
}

// Whole pages that are unknown or known without a range, and page-aligned stretches
// that allocations tile (their edges anywhere), so that a page the driver answers alone
// never shares bytes with an allocation.
FakeDriver MakeLayout(std::mt19937_64& rng) {
  FakeDriver d;
  int64_t at = kPage * static_cast<int64_t>(1 + rng() % (int64_t{1} << 30));
  const int blocks = 1 + rng() % 8;
  for (int b = 0; b < blocks; ++b) {
    const int64_t pages = 1 + rng() % 4;
    const MemoryKind kind = rng() % 2 ? MemoryKind::kHost : MemoryKind::kDevice;
    const int ordinal = kind == MemoryKind::kDevice ? static_cast<int>(rng() % 4) : -1;
    switch (rng() % 3) {
      case 0:  // unknown
        break;
      case 1:
        d.regions.push_back({at, at + pages * kPage, kind, ordinal, false});
        break;
      default: {
        std::set<int64_t> cuts{at, at + pages * kPage};
        for (int c = rng() % 4; c > 0; --c) cuts.insert(at + 1 + rng() % (pages * kPage - 1));
        for (auto it = cuts.begin(); std::next(it) != cuts.end(); ++it) {
          const MemoryKind k = rng() % 2 ? MemoryKind::kHost : MemoryKind::kDevice;
          d.regions.push_back({*it, *std::next(it), k, static_cast<int>(rng() % 4), true});
        }
      }
    }
    at += pages * kPage;
  }
  d.wrong_range = rng() % 2;
  return d;
}

void TestRandomLayouts(std::mt19937_64& rng) {
  for (int trial = 0; trial < 2000; ++trial) {
    FakeDriver d = MakeLayout(rng);
    const int64_t first = d.regions.empty() ? kPage : d.regions.front().start;
    const int64_t last = d.regions.empty() ? 2 * kPage : d.regions.back().end;
    // Addresses at and beside every edge, and anywhere, in random order, some twice.
    std::vector<int64_t> addresses;
    for (const Region& r : d.regions) {
      for (int64_t a : {r.start - 1, r.start, r.start + 1, r.end - 1, r.end, r.end + 1}) {
        addresses.push_back(a);
      }
    }
    for (int k = 0; k < 40; ++k) {
      addresses.push_back(first - kPage + static_cast<int64_t>(rng() % (last - first + 2 * kPage)));
    }
    std::shuffle(addresses.begin(), addresses.end(), rng);
    for (size_t k = 0; k < addresses.size(); k += 1 + rng() % 5) addresses.push_back(addresses[k]);
    MemoryMap map = d.Map();
    std::set<int64_t> asked;  // the ranges asked about, by first address
    for (int64_t a : addresses) {
      const auto [want, range] = Expected(d, a);
      const Memory got = map.At(a);
      EXPECT(Same(got, want));
      asked.insert(range);
      EXPECT(d.calls == static_cast<int64_t>(asked.size()));
    }
  }
}

void TestEdges() {
  // A lone page the driver does not know, at the bottom and at the top of the space.
  FakeDriver d;
  MemoryMap map = d.Map();
  EXPECT(Same(map.At(0), Memory{kPage, MemoryKind::kUnknown, -1}));
  EXPECT(Same(map.At(kPage - 1), Memory{kPage, MemoryKind::kUnknown, -1}));
  EXPECT(d.calls == 1);
  EXPECT(Same(map.At(kPage), Memory{2 * kPage, MemoryKind::kUnknown, -1}));
  EXPECT(d.calls == 2);
  // The last page ends at INT64_MAX, not past it; its last byte is INT64_MAX - 1.
  EXPECT(Same(map.At(INT64_MAX - 1), Memory{INT64_MAX, MemoryKind::kUnknown, -1}));
  EXPECT(Same(map.At(INT64_MAX - kPage + 1), Memory{INT64_MAX, MemoryKind::kUnknown, -1}));
  EXPECT(d.calls == 3);
  EXPECT(Same(map.At(INT64_MAX - kPage), Memory{INT64_MAX - kPage + 1, MemoryKind::kUnknown, -1}));
  EXPECT(d.calls == 4);

  // An allocation ending at INT64_MAX; its neighbour below starts mid-page.
  d = FakeDriver{};
  d.regions = {{INT64_MAX - 5000, INT64_MAX - 100, MemoryKind::kHost, -1, true},
               {INT64_MAX - 100, INT64_MAX, MemoryKind::kDevice, 3, true}};
  MemoryMap top = d.Map();
  EXPECT(Same(top.At(INT64_MAX - 1), Memory{INT64_MAX, MemoryKind::kDevice, 3}));
  EXPECT(Same(top.At(INT64_MAX - 100), Memory{INT64_MAX, MemoryKind::kDevice, 3}));
  EXPECT(Same(top.At(INT64_MAX - 101), Memory{INT64_MAX - 100, MemoryKind::kHost, -1}));
  EXPECT(Same(top.At(INT64_MAX - 5000), Memory{INT64_MAX - 100, MemoryKind::kHost, -1}));
  EXPECT(Same(top.At(INT64_MAX - 50), Memory{INT64_MAX, MemoryKind::kDevice, 3}));
  EXPECT(d.calls == 2);

  // A range that misses the address, or has no size, counts for nothing: the page does.
  int64_t calls = 0;
  MemoryMap odd([&](int64_t address) {
    ++calls;
    if (address < 10 * kPage) return PointerAttributes{MemoryKind::kHost, -1, address + 1, kPage};
    return PointerAttributes{MemoryKind::kDevice, 0, address, 0};
  });
  EXPECT(Same(odd.At(3 * kPage + 5), Memory{4 * kPage, MemoryKind::kHost, -1}));
  EXPECT(Same(odd.At(20 * kPage + 5), Memory{21 * kPage, MemoryKind::kDevice, 0}));
  EXPECT(calls == 2);
  MemoryMap before([&](int64_t address) {  // a range that ends just before the address
    ++calls;
    return PointerAttributes{MemoryKind::kHost, -1, address - 10, 10};
  });
  EXPECT(Same(before.At(5 * kPage + 20), Memory{6 * kPage, MemoryKind::kHost, -1}));
  calls = 0;
  // A range that starts exactly at the address, and one that ends right after it.
  MemoryMap exact([&](int64_t address) {
    ++calls;
    return address == 1000 ? PointerAttributes{MemoryKind::kDevice, 1, 1000, 1}
                           : PointerAttributes{MemoryKind::kDevice, 2, 100, address - 99};
  });
  EXPECT(Same(exact.At(1000), Memory{1001, MemoryKind::kDevice, 1}));
  EXPECT(Same(exact.At(999), Memory{1000, MemoryKind::kDevice, 2}));
  EXPECT(Same(exact.At(1000), Memory{1001, MemoryKind::kDevice, 1}));
  EXPECT(Same(exact.At(100), Memory{1000, MemoryKind::kDevice, 2}));
  EXPECT(calls == 2);
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(99);
  kvoffload::TestRandomLayouts(rng);
  kvoffload::TestEdges();
  return kvoffload::TestResult("memory_map_test");
}
