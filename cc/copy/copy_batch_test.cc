// ValidateCopyBatch, IsSrcAccessOrder and TotalBytes, against a reference validator on
// random batches full of edge values.

#include "cc/copy/copy_batch.h"

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

struct Batch {
  std::vector<int64_t> src, dst, size;
  std::vector<uint8_t> order;  // empty: no order array
  CopyBatch View() const {
    return CopyBatch{src.data(), dst.data(), size.data(), static_cast<int64_t>(size.size()),
                     order.empty() ? nullptr : order.data()};
  }
};

// The message ValidateCopyBatch must throw for `b`, or "(no exception)": the first bad
// copy, and in it the first broken rule in the documented order. Overflow is checked in
// 128-bit arithmetic.
std::string ReferenceMessage(const Batch& b) {
  for (size_t i = 0; i < b.size.size(); ++i) {
    const std::string at = "[" + std::to_string(i) + "]: ";
    const int64_t src = b.src[i], dst = b.dst[i], size = b.size[i];
    if (size <= 0) return "sizes" + at + "must be > 0, got " + std::to_string(size);
    if (src == 0) return "src" + at + "null pointer";
    if (dst == 0) return "dst" + at + "null pointer";
    if (src < 0) return "src" + at + "negative address";
    if (dst < 0) return "dst" + at + "negative address";
    const __int128 end_src = __int128{src} + size, end_dst = __int128{dst} + size;
    if (end_src > INT64_MAX || end_dst > INT64_MAX) {
      return "sizes" + at + std::to_string(size) + " bytes run past the end of the address space";
    }
    if (!b.order.empty() && (b.order[i] < 1 || b.order[i] > 3)) {
      return "order" + at + std::to_string(b.order[i]) + " is not a source access order";
    }
  }
  return "(no exception)";
}

// An int64 that is mostly an ordinary address or size, else an edge value.
int64_t Value(std::mt19937_64& rng, int64_t ordinary_max) {
  const int64_t edges[] = {0,         1,         -1,        INT64_MIN,     INT64_MIN + 1,
                           INT64_MAX, INT64_MAX - 1, INT64_MAX - 4096, int64_t{1} << 62,
                           -4096};
  switch (rng() % 4) {
    case 0:
      return edges[rng() % (sizeof(edges) / sizeof(edges[0]))];
    case 1:
      return static_cast<int64_t>(rng());  // any bits, negative half the time
    default:
      return 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(ordinary_max));
  }
}

void TestRandomBatchesMatchReference(std::mt19937_64& rng) {
  int valid = 0, rejected = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    Batch b;
    const int count = rng() % 12;
    // Mostly-valid batches, so that the bad copy falls at any index.
    const bool clean = rng() % 3 == 0;
    for (int i = 0; i < count; ++i) {
      // All three fields of a copy may be edge values at once.
      const bool edge = !clean && rng() % (count + 1) == 0;
      b.src.push_back(edge ? Value(rng, int64_t{1} << 48) : 1 + rng() % (int64_t{1} << 48));
      b.dst.push_back(edge ? Value(rng, int64_t{1} << 48) : 1 + rng() % (int64_t{1} << 48));
      b.size.push_back(edge ? Value(rng, int64_t{1} << 20) : 1 + rng() % (int64_t{1} << 20));
    }
    if (rng() % 2) {
      for (int i = 0; i < count; ++i) {
        const bool edge = !clean && rng() % (count + 1) == 0;
        b.order.push_back(edge ? static_cast<uint8_t>(rng()) : 1 + rng() % 3);
      }
    }
    const std::string want = ReferenceMessage(b);
    const std::string got = InvalidArgument([&] { ValidateCopyBatch(b.View()); });
    EXPECT(got == want);
    if (got != want) std::fprintf(stderr, "  got %s\n  want %s\n", got.c_str(), want.c_str());
    (want == "(no exception)" ? valid : rejected)++;
  }
  // Both outcomes were exercised.
  EXPECT(valid > 2000 && rejected > 2000);
}

std::string Check(int64_t src, int64_t dst, int64_t size, int order = -1) {
  Batch b{{src}, {dst}, {size}, {}};
  if (order >= 0) b.order.push_back(static_cast<uint8_t>(order));
  return InvalidArgument([&] { ValidateCopyBatch(b.View()); });
}

void TestEdges() {
  const std::string ok = "(no exception)";
  // An empty batch needs no arrays; a negative count is refused.
  EXPECT(InvalidArgument([] { ValidateCopyBatch(CopyBatch{}); }) == ok);
  EXPECT(InvalidArgument([] { ValidateCopyBatch(CopyBatch{nullptr, nullptr, nullptr, -1}); }) ==
         "count: must be >= 0, got -1");
  EXPECT(InvalidArgument([] {
           ValidateCopyBatch(CopyBatch{nullptr, nullptr, nullptr, INT64_MIN});
         }) == "count: must be >= 0, got " + std::to_string(INT64_MIN));
  // Sizes: zero and negative.
  EXPECT(Check(8, 16, 0) == "sizes[0]: must be > 0, got 0");
  EXPECT(Check(8, 16, -5) == "sizes[0]: must be > 0, got -5");
  EXPECT(Check(8, 16, INT64_MIN) == "sizes[0]: must be > 0, got " + std::to_string(INT64_MIN));
  EXPECT(Check(8, 16, 1) == ok);
  // Null before negative, src before dst, size before either.
  EXPECT(Check(0, 0, 0) == "sizes[0]: must be > 0, got 0");
  EXPECT(Check(0, 0, 4) == "src[0]: null pointer");
  EXPECT(Check(0, -1, 4) == "src[0]: null pointer");
  EXPECT(Check(-1, 0, 4) == "dst[0]: null pointer");
  EXPECT(Check(-1, -1, 4) == "src[0]: negative address");
  EXPECT(Check(-1, -2, 4) == "src[0]: negative address");
  EXPECT(Check(INT64_MIN, 8, 4) == "src[0]: negative address");
  EXPECT(Check(8, INT64_MIN, 4) == "dst[0]: negative address");
  // The last byte may be at INT64_MAX - 1 (end == INT64_MAX), not one further.
  EXPECT(Check(INT64_MAX - 10, 8, 10) == ok);
  EXPECT(Check(8, INT64_MAX - 10, 10) == ok);
  EXPECT(Check(1, 1, INT64_MAX - 1) == ok);
  EXPECT(Check(INT64_MAX - 10, 8, 11) ==
         "sizes[0]: 11 bytes run past the end of the address space");
  EXPECT(Check(8, INT64_MAX - 10, 11) ==
         "sizes[0]: 11 bytes run past the end of the address space");
  EXPECT(Check(1, 1, INT64_MAX) ==
         "sizes[0]: " + std::to_string(INT64_MAX) + " bytes run past the end of the address space");
  EXPECT(Check(INT64_MAX, INT64_MAX, INT64_MAX) ==
         "sizes[0]: " + std::to_string(INT64_MAX) + " bytes run past the end of the address space");
  // Order values: 1-3 are the driver's; the message prints the number, not a character.
  for (int v = 0; v < 256; ++v) {
    EXPECT(Check(8, 16, 4, v) ==
           (v >= 1 && v <= 3 ? ok : "order[0]: " + std::to_string(v) + " is not a source access order"));
  }
  // A bad order is reported only after the copy's other fields pass.
  EXPECT(Check(8, 16, 0, 9) == "sizes[0]: must be > 0, got 0");
  // The first bad copy is named, not a later one, and its index is right.
  Batch b{{8, 8, 0, 8}, {16, 16, 16, -3}, {4, 4, 4, 4}, {}};
  EXPECT(InvalidArgument([&] { ValidateCopyBatch(b.View()); }) == "src[2]: null pointer");
  b.src[2] = 8;
  EXPECT(InvalidArgument([&] { ValidateCopyBatch(b.View()); }) == "dst[3]: negative address");
}

void TestSrcAccessOrder() {
  for (int64_t v : {int64_t{-1}, int64_t{0}, int64_t{4}, int64_t{255}, int64_t{257}, int64_t{258},
                    int64_t{259}, INT64_MIN, INT64_MAX, int64_t{1} << 32 | 1}) {
    EXPECT(!IsSrcAccessOrder(v));
  }
  EXPECT(IsSrcAccessOrder(1) && IsSrcAccessOrder(2) && IsSrcAccessOrder(3));
  EXPECT(static_cast<int>(SrcAccessOrder::kStream) == 1);
  EXPECT(static_cast<int>(SrcAccessOrder::kDuringApiCall) == 2);
  EXPECT(static_cast<int>(SrcAccessOrder::kAny) == 3);
}

void TestTotalBytes(std::mt19937_64& rng) {
  EXPECT(TotalBytes(CopyBatch{}) == 0);
  for (int trial = 0; trial < 200; ++trial) {
    Batch b;
    int64_t want = 0;
    const int count = rng() % 50;
    for (int i = 0; i < count; ++i) {
      b.src.push_back(8);
      b.dst.push_back(16);
      b.size.push_back(1 + rng() % (int64_t{1} << 40));
      want += b.size.back();
    }
    EXPECT(TotalBytes(b.View()) == want);
  }
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(20240514);
  kvoffload::TestRandomBatchesMatchReference(rng);
  kvoffload::TestEdges();
  kvoffload::TestSrcAccessOrder();
  kvoffload::TestTotalBytes(rng);
  return kvoffload::TestResult("copy_batch_test");
}
