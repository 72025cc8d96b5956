// RequireReachableIn against a reference that asks the fake driver about each copy's
// first and last byte, on random batches over random allocations: the same verdict, the
// same message (side, index, address, reason), and one query per allocation.

#include "cc/memory/reach_check.h"

#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cc/memory/memory_map.h"
#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

struct Allocation {
  int64_t start, end;
  MemoryKind kind;
  int ordinal;  // -1 for host memory
};

// Allocations the driver names a range for; it knows nothing else.
struct FakeDriver {
  std::vector<Allocation> allocations;
  int64_t calls = 0;

  const Allocation* Find(int64_t address) const {
    for (const Allocation& a : allocations) {
      if (a.start <= address && address < a.end) return &a;
    }
    return nullptr;
  }
  MemoryMap Map() {
    return MemoryMap([this](int64_t address) {
      ++calls;
      const Allocation* a = Find(address);
      return a ? PointerAttributes{a->kind, a->ordinal, a->start, a->end - a->start}
               : PointerAttributes{};
    });
  }
};

const char* const kPageable =
    "is neither page-locked host memory nor device memory (pageable host memory?); kernels "
    "reach host memory through the GPU's mapping, so page-lock it (kvoffload.host_register or "
    "a pinned allocation) or use the batch copy";

// The reason an address fails `reach` on `device`, or "" when it does not.
std::string ReferenceWhy(const Allocation* a, int device, Reach reach) {
  if (a == nullptr) return kPageable;
  const bool wrong_kind = (reach == Reach::kDevice && a->kind == MemoryKind::kHost) ||
                          (reach == Reach::kPinnedHost && a->kind == MemoryKind::kDevice);
  if (wrong_kind) {
    return a->kind == MemoryKind::kHost ? "is host memory where device memory is needed"
                                        : "is device memory where page-locked host memory is needed";
  }
  if (a->kind == MemoryKind::kDevice && a->ordinal != device) {
    std::ostringstream why;
    why << "is memory of device " << a->ordinal << ", but the stream is on device " << device;
    return why.str();
  }
  return "";
}

std::string ReferenceMessage(const FakeDriver& d, const std::vector<int64_t>& addresses,
                             const std::vector<int64_t>& sizes, int device, Reach reach,
                             const std::string& side) {
  for (size_t i = 0; i < addresses.size(); ++i) {
    for (int64_t address : {addresses[i], addresses[i] + sizes[i] - 1}) {
      const std::string why = ReferenceWhy(d.Find(address), device, reach);
      if (!why.empty()) {
        std::ostringstream message;
        message << side << "[" << i << "]: 0x" << std::hex << address << " " << why;
        return message.str();
      }
    }
  }
  return "(no exception)";
}

std::string Check(FakeDriver& d, const std::vector<int64_t>& addresses,
                  const std::vector<int64_t>& sizes, int device, Reach reach, const char* side) {
  MemoryMap map = d.Map();
  return InvalidArgument([&] {
    RequireReachableIn(map, addresses.data(), sizes.data(), static_cast<int64_t>(sizes.size()),
                       device, reach, side);
  });
}

void TestRandomBatchesMatchReference(std::mt19937_64& rng) {
  const Reach reaches[] = {Reach::kDeviceOrPinnedHost, Reach::kPinnedHost, Reach::kDevice};
  const char* const sides[] = {"src", "dst", "gpu_base", "cpu_base"};
  int passed = 0, rejected = 0;
  for (int trial = 0; trial < 5000; ++trial) {
    // Allocations back to back or apart, of one or the other kind, on devices 0-2.
    FakeDriver d;
    int64_t at = int64_t{1} << (32 + rng() % 14);
    const int n = 1 + rng() % 6;
    for (int k = 0; k < n; ++k) {
      const int64_t size = 1 + rng() % 20000;
      const bool host = rng() % 2;
      const MemoryKind kind = host ? MemoryKind::kHost : MemoryKind::kDevice;
      d.allocations.push_back({at, at + size, kind, host ? -1 : static_cast<int>(rng() % 3)});
      at += size + (rng() % 2 ? 0 : rng() % 10000);
    }
    const int device = rng() % 3;
    const Reach reach = reaches[rng() % 3];
    // Mostly copies inside one allocation, some past its end or outside every one.
    const bool clean = rng() % 3 == 0;
    std::vector<int64_t> addresses, sizes;
    const int count = rng() % 20;
    std::vector<const Allocation*> fitting;
    for (const Allocation& a : d.allocations) {
      if (ReferenceWhy(&a, device, reach).empty()) fitting.push_back(&a);
    }
    for (int i = 0; i < count; ++i) {
      const Allocation& a = (clean && !fitting.empty())
                                ? *fitting[rng() % fitting.size()]
                                : d.allocations[rng() % d.allocations.size()];
      const int64_t offset = rng() % (a.end - a.start);
      int64_t size = 1 + rng() % (a.end - a.start - offset);
      if (!clean && rng() % 8 == 0) size += rng() % 20000;
      addresses.push_back(a.start + offset);
      sizes.push_back(size);
    }
    const char* side = sides[rng() % 4];
    const std::string want = ReferenceMessage(d, addresses, sizes, device, reach, side);
    const std::string got = Check(d, addresses, sizes, device, reach, side);
    EXPECT(got == want);
    if (got != want) std::fprintf(stderr, "  got  %s\n  want %s\n", got.c_str(), want.c_str());
    // The driver was asked at most once per allocation, plus once for an unknown page.
    EXPECT(d.calls <= n + 1);
    (want == "(no exception)" ? passed : rejected)++;
  }
  EXPECT(passed > 1000 && rejected > 1000);
}

void TestEdges() {
  FakeDriver d;
  const int64_t base = 0x7f0000000000;
  d.allocations = {{base, base + 4096, MemoryKind::kDevice, 0},
                   {base + 4096, base + 8192, MemoryKind::kDevice, 1},
                   {base + 8192, base + 9000, MemoryKind::kHost, -1}};
  const Reach any = Reach::kDeviceOrPinnedHost;
  // No copies: nothing to ask.
  EXPECT(Check(d, {}, {}, 0, Reach::kDevice, "src") == "(no exception)" && d.calls == 0);
  // A copy ending on its allocation's last byte passes; one byte more reaches device 1.
  EXPECT(Check(d, {base}, {4096}, 0, any, "src") == "(no exception)");
  EXPECT(Check(d, {base}, {4097}, 0, any, "src") ==
         "src[0]: 0x7f0000001000 is memory of device 1, but the stream is on device 0");
  // Only the first and last bytes count: a copy across device 1's memory, from device 0's
  // to host memory, passes for device 0.
  EXPECT(Check(d, {base + 10}, {8190}, 0, any, "dst") == "(no exception)");
  // The copy named is the first bad one; its first byte is looked at before its last.
  EXPECT(Check(d, {base, base + 8192, base + 4096}, {16, 808, 16}, 0, any, "gpu_base") ==
         "gpu_base[2]: 0x7f0000001000 is memory of device 1, but the stream is on device 0");
  EXPECT(Check(d, {base + 8192}, {809}, 0, any, "cpu_base") ==
         "cpu_base[0]: 0x7f0000002328 " + std::string(kPageable));
  EXPECT(Check(d, {base - 1}, {2}, 0, any, "src") == "src[0]: 0x7effffffffff " + std::string(kPageable));
  // Each reach and kind.
  EXPECT(Check(d, {base + 8192}, {8}, 0, Reach::kDevice, "dst") ==
         "dst[0]: 0x7f0000002000 is host memory where device memory is needed");
  EXPECT(Check(d, {base}, {8}, 0, Reach::kPinnedHost, "dst") ==
         "dst[0]: 0x7f0000000000 is device memory where page-locked host memory is needed");
  EXPECT(Check(d, {base + 8192}, {8}, 5, Reach::kPinnedHost, "dst") == "(no exception)");
  EXPECT(Check(d, {base + 4096}, {8}, 1, Reach::kDevice, "dst") == "(no exception)");
  // Many copies in few allocations: one query per allocation, not per copy.
  d.calls = 0;
  std::vector<int64_t> addresses, sizes;
  for (int i = 0; i < 1000; ++i) {
    addresses.push_back(base + (i % 2) * 8192 + i % 700);
    sizes.push_back(1 + i % 100);
  }
  EXPECT(Check(d, addresses, sizes, 0, any, "src") == "(no exception)" && d.calls == 2);
  // Memory at the top of the address space.
  d.allocations = {{INT64_MAX - 64, INT64_MAX, MemoryKind::kHost, -1}};
  EXPECT(Check(d, {INT64_MAX - 64}, {64}, 0, any, "src") == "(no exception)");
  EXPECT(Check(d, {INT64_MAX - 65}, {65}, 0, any, "src") ==
         "src[0]: 0x7fffffffffffffbe " + std::string(kPageable));
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(2718);
  kvoffload::TestRandomBatchesMatchReference(rng);
  kvoffload::TestEdges();
  return kvoffload::TestResult("reach_check_test");
}
