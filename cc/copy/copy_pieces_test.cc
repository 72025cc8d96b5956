// SplitIntoPieces against a piece-by-piece reference on random batches and piece sizes.

#include "cc/copy/copy_pieces.h"

#include <cstdint>
#include <random>
#include <vector>

#include "cc/copy/copy_batch.h"
#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

struct Batch {
  std::vector<int64_t> src, dst, size;
  CopyBatch View() const {
    return CopyBatch{src.data(), dst.data(), size.data(), static_cast<int64_t>(size.size())};
  }
};

// Piece j of copy i starts j * piece_bytes into it; copy i has ceil(size / piece_bytes)
// pieces, the number of piece starts below its size.
std::vector<int64_t> ReferencePieces(const Batch& b, int64_t piece_bytes) {
  std::vector<int64_t> src, dst, size;
  for (size_t i = 0; i < b.size.size(); ++i) {
    const int64_t pieces = (b.size[i] - 1) / piece_bytes + 1;
    for (int64_t j = 0; j < pieces; ++j) {
      const int64_t offset = j * piece_bytes;
      src.push_back(b.src[i] + offset);
      dst.push_back(b.dst[i] + offset);
      size.push_back(j == pieces - 1 ? b.size[i] - offset : piece_bytes);
    }
  }
  std::vector<int64_t> out(src);
  out.insert(out.end(), dst.begin(), dst.end());
  out.insert(out.end(), size.begin(), size.end());
  return out;
}

void TestRandomBatchesMatchReference(std::mt19937_64& rng) {
  std::vector<int64_t> out;  // reused, as KernelCopy reuses it launch after launch
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t piece_bytes = rng() % 4 == 0 ? 16 * (1 + rng() % 8) : 1 + rng() % 5000;
    Batch b;
    const int count = rng() % 40;
    for (int i = 0; i < count; ++i) {
      b.src.push_back(1 + rng() % (int64_t{1} << 47));
      b.dst.push_back(1 + rng() % (int64_t{1} << 47));
      // Sizes at, next to and between multiples of the piece size.
      const int64_t k = rng() % 5;
      switch (rng() % 4) {
        case 0:
          b.size.push_back(std::max<int64_t>(1, k * piece_bytes));
          break;
        case 1:
          b.size.push_back(k * piece_bytes + 1);
          break;
        case 2:
          b.size.push_back(std::max<int64_t>(1, (k + 1) * piece_bytes - 1));
          break;
        default:
          b.size.push_back(1 + rng() % (6 * piece_bytes));
      }
    }
    ValidateCopyBatch(b.View());
    const std::vector<int64_t> want = ReferencePieces(b, piece_bytes);
    const int64_t n = SplitIntoPieces(b.View(), piece_bytes, out);
    EXPECT(n * 3 == static_cast<int64_t>(want.size()));
    EXPECT(out == want);
  }
}

void TestEdges() {
  std::vector<int64_t> out{1, 2, 3};
  // An empty batch: no pieces, and stale entries are gone.
  EXPECT(SplitIntoPieces(CopyBatch{}, 64, out) == 0 && out.empty());

  // Exactly one piece, one byte over, one byte under.
  Batch b{{100, 200, 300}, {1000, 2000, 3000}, {64, 65, 63}};
  EXPECT(SplitIntoPieces(b.View(), 64, out) == 4);
  EXPECT((out == std::vector<int64_t>{100, 200, 264, 300,        // src
                                      1000, 2000, 2064, 3000,    // dst
                                      64, 64, 1, 63}));          // size
  // Pieces of one byte: one per byte.
  b = Batch{{7}, {9}, {3}};
  EXPECT(SplitIntoPieces(b.View(), 1, out) == 3);
  EXPECT((out == std::vector<int64_t>{7, 8, 9, 9, 10, 11, 1, 1, 1}));

  // Copies ending at INT64_MAX, and pieces so large that size + piece_bytes passes it.
  const int64_t big = int64_t{1} << 62;
  b = Batch{{1, INT64_MAX - 100}, {INT64_MAX - big - 5, 1}, {big + 5, 100}};
  ValidateCopyBatch(b.View());
  EXPECT(SplitIntoPieces(b.View(), big, out) == 3);
  EXPECT((out == std::vector<int64_t>{1, 1 + big, INT64_MAX - 100,
                                      INT64_MAX - big - 5, INT64_MAX - 5, 1,
                                      big, 5, 100}));
  for (const int64_t piece : {INT64_MAX, INT64_MAX - 1, big + 4, big + 5, big + 6}) {
    const int64_t n = SplitIntoPieces(b.View(), piece, out);
    EXPECT(n == (piece >= big + 5 ? 2 : 3));
    EXPECT(out == ReferencePieces(b, piece));
  }
  b = Batch{{1}, {1}, {INT64_MAX - 1}};
  ValidateCopyBatch(b.View());
  EXPECT(SplitIntoPieces(b.View(), INT64_MAX, out) == 1);
  EXPECT((out == std::vector<int64_t>{1, 1, INT64_MAX - 1}));
  EXPECT(SplitIntoPieces(b.View(), INT64_MAX / 2, out) == 2);
  EXPECT((out == std::vector<int64_t>{1, 1 + INT64_MAX / 2, 1, 1 + INT64_MAX / 2,
                                      INT64_MAX / 2, INT64_MAX / 2}));
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(4242);
  kvoffload::TestRandomBatchesMatchReference(rng);
  kvoffload::TestEdges();
  return kvoffload::TestResult("copy_pieces_test");
}
