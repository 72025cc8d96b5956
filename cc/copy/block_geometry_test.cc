// BlockGeometryOf against a reference that lists every element's offset: a block is
// contiguous when its elements, in row-major order, lie at offsets 0, 1, 2, ... from its
// start, and the blocks must follow one another up memory without overlapping.

#include "cc/copy/block_geometry.h"

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

std::string Text(const BlockGeometry& g) {
  return "{" + std::to_string(g.blocks) + ", " + std::to_string(g.block_bytes) + ", " +
         std::to_string(g.stride_bytes) + "}";
}

std::string Geometry(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                     int64_t itemsize, const std::string& name = "t") {
  std::string text;
  const std::string error =
      InvalidArgument([&] { text = Text(BlockGeometryOf(shape, strides, itemsize, name)); });
  return error == "(no exception)" ? text : error;
}

// Every element's offset from its block's start, block by block in row-major order.
std::vector<std::vector<int64_t>> BlockOffsets(const std::vector<int64_t>& shape,
                                               const std::vector<int64_t>& strides) {
  std::vector<std::vector<int64_t>> blocks(shape[0]);
  for (std::vector<int64_t>& offsets : blocks) {
    std::vector<int64_t> index(shape.size(), 0);
    bool empty = false;
    for (size_t d = 1; d < shape.size(); ++d) empty |= shape[d] == 0;
    while (!empty) {
      int64_t offset = 0;
      for (size_t d = 1; d < shape.size(); ++d) offset += index[d] * strides[d];
      offsets.push_back(offset);
      size_t d = shape.size();
      while (--d >= 1 && ++index[d] == shape[d]) index[d] = 0;
      if (d == 0) break;
    }
  }
  return blocks;
}

std::string Reference(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                      int64_t itemsize) {
  if (shape.empty()) return "t: needs a block dimension";
  const std::vector<std::vector<int64_t>> blocks = BlockOffsets(shape, strides);
  int64_t elements = 1;
  for (size_t d = 1; d < shape.size(); ++d) elements *= shape[d];
  for (const std::vector<int64_t>& offsets : blocks) {
    for (size_t k = 0; k < offsets.size(); ++k) {
      if (offsets[k] != static_cast<int64_t>(k)) {
        return "t: each block (dims 1 and up) must be contiguous";
      }
    }
  }
  if (shape[0] > 1 && elements > 0 && strides[0] < 0) {
    return "t: has a negative dim-0 stride (" + std::to_string(strides[0]) +
           "; a reversed view): blocks must go forwards";
  }
  for (int64_t i = 0; i + 1 < shape[0] && elements > 0; ++i) {
    const int64_t end = i * strides[0] + elements, next = (i + 1) * strides[0];
    if (next < end) {
      return "t: blocks overlap (dim-0 stride " + std::to_string(strides[0]) + " < block size " +
             std::to_string(elements) + " elements)";
    }
  }
  return Text({shape[0], elements * itemsize, strides[0] * itemsize});
}

// Mostly row-major strides; some dims get a random one, which a size-1 dim may keep.
void TestRandomTensorsMatchReference(std::mt19937_64& rng) {
  int counts[3] = {0, 0, 0};  // accepted, not contiguous, overlapping
  for (int trial = 0; trial < 20000; ++trial) {
    const size_t ndim = rng() % 5;
    std::vector<int64_t> shape(ndim), strides(ndim);
    for (int64_t& n : shape) n = rng() % 12 == 0 ? 0 : 1 + rng() % 4;
    int64_t elements = 1;
    for (size_t d = ndim; d-- > 0;) {
      strides[d] = elements;
      if (d == 0 || rng() % 5 == 0) strides[d] = static_cast<int64_t>(rng() % 40) - 5;
      if (d == 0 && rng() % 2 == 0) strides[d] = elements + rng() % 3;
      elements *= shape[d];
    }
    const int64_t itemsize = int64_t{1} << (rng() % 4);
    const std::string want = Reference(shape, strides, itemsize);
    const std::string got = Geometry(shape, strides, itemsize);
    EXPECT(got == want);
    if (got != want) std::fprintf(stderr, "  got  %s\n  want %s\n", got.c_str(), want.c_str());
    counts[want[0] == '{' ? 0 : want.find("contiguous") != std::string::npos ? 1 : 2]++;
  }
  EXPECT(counts[0] > 5000 && counts[1] > 1000 && counts[2] > 1000);
}

void TestEdges() {
  // The argument is named; a rank-0 tensor has no blocks.
  EXPECT(Geometry({}, {}, 4, "src") == "src: needs a block dimension");
  // A layer of a [layers, blocks, ...] cache: dim-0 stride past the block.
  EXPECT(Geometry({8, 4, 4}, {32, 4, 1}, 2) == "{8, 32, 64}");
  EXPECT(Geometry({8, 4, 4}, {16, 1, 4}, 2, "dst") ==
         "dst: each block (dims 1 and up) must be contiguous");
  // Size-1 dims have any stride, the block's included; an empty tensor any strides.
  EXPECT(Geometry({3, 1, 5, 1}, {5, 99, 1, -7}, 4) == "{3, 20, 20}");
  EXPECT(Geometry({1, 6}, {-3, 1}, 8) == "{1, 48, -24}");
  EXPECT(Geometry({0, 3, 5}, {1, 1, 9}, 4) == "{0, 60, 4}");
  EXPECT(Geometry({4, 3, 0}, {0, 7, 7}, 4) == "{4, 0, 0}");
  // Blocks that touch are fine; one element of overlap, or a reversed order, is not.
  EXPECT(Geometry({4, 10}, {10, 1}, 1) == "{4, 10, 10}");
  EXPECT(Geometry({4, 10}, {9, 1}, 1, "dst") ==
         "dst: blocks overlap (dim-0 stride 9 < block size 10 elements)");
  EXPECT(Geometry({2, 10}, {-10, 1}, 1) ==
         "t: has a negative dim-0 stride (-10; a reversed view): blocks must go forwards");
  // What no tensor has: mismatched strides, negative dims, sizes past int64.
  EXPECT(Geometry({2, 3}, {3}, 4) == "t: has 1 strides for 2 dims");
  EXPECT(Geometry({2, -3}, {3, 1}, 4) == "t: dim 1 is negative");
  EXPECT(Geometry({2, 3}, {3, 1}, -1) == "t: item size must be >= 0, got -1");
  EXPECT(Geometry({2, int64_t{1} << 32, int64_t{1} << 32}, {0, 1, 1}, 1) ==
         "t: has too many elements");
  EXPECT(Geometry({0, int64_t{1} << 32, int64_t{1} << 32}, {0, 1, 1}, 1) ==
         "t: has too many elements");
  EXPECT(Geometry({1, int64_t{1} << 62}, {0, 1}, 4) == "t: has too many bytes");
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(1414);
  kvoffload::TestRandomTensorsMatchReference(rng);
  kvoffload::TestEdges();
  return kvoffload::TestResult("block_geometry_test");
}
