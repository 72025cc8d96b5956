// MapBlocks against a reference that checks the mapping row by row and then compares
// every source block with every destination block, on random mappings between two
// tensors and between views of one buffer: the same addresses, or the same message.

#include "cc/copy/block_mapping.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cc/copy/block_geometry.h"
#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

using Mapping = std::vector<int64_t>;  // rows of (source block, destination block)

BlockTensorAt Tensor(int64_t blocks, int64_t block_bytes, int64_t stride_bytes, int64_t base) {
  return BlockTensorAt{BlockGeometry{blocks, block_bytes, stride_bytes}, base};
}

std::string Text(const BlockCopies& c) {
  std::string text;
  for (int64_t i = 0; i < c.count(); ++i) {
    text += std::to_string(c.src[i]) + "->" + std::to_string(c.dst[i]) + ":" +
            std::to_string(c.size[i]) + " ";
  }
  return text;
}

std::string Map(const BlockTensorAt& src, const BlockTensorAt& dst, const Mapping& m) {
  std::string text;
  const std::string error = InvalidArgument(
      [&] { text = Text(MapBlocks(src, dst, m.data(), static_cast<int64_t>(m.size() / 2))); });
  return error == "(no exception)" ? text : error;
}

std::string Row(size_t i, int column) {
  return "block_mapping[" + std::to_string(i) + ", " + std::to_string(column) + "]: ";
}

int64_t Address(const BlockTensorAt& t, int64_t block) {
  return t.base + block * t.geometry.stride_bytes;
}

// What MapBlocks must do: the copies' text, or the message it throws; when several
// destination blocks share memory with source blocks, any one of their messages.
std::set<std::string> Reference(const BlockTensorAt& src, const BlockTensorAt& dst,
                                const Mapping& m) {
  const int64_t bytes = src.geometry.block_bytes;
  const size_t rows = m.size() / 2;  // all checked; zero-byte blocks copy nothing
  std::set<int64_t> written;
  for (size_t i = 0; i < rows; ++i) {
    const int64_t s = m[2 * i], d = m[2 * i + 1];
    if (s < 0 || s >= src.geometry.blocks) {
      return {Row(i, 0) + "source block " + std::to_string(s) + " is out of range for src with " +
              std::to_string(src.geometry.blocks) + " blocks"};
    }
    if (d < 0 || d >= dst.geometry.blocks) {
      return {Row(i, 1) + "destination block " + std::to_string(d) +
              " is out of range for dst with " + std::to_string(dst.geometry.blocks) + " blocks"};
    }
    if (!written.insert(d).second) {
      return {Row(i, 1) + "destination block " + std::to_string(d) + " is written twice"};
    }
  }
  std::set<std::string> shared;
  std::string copies;
  const size_t moved = bytes == 0 ? 0 : rows;
  for (size_t i = 0; i < moved; ++i) {
    const int64_t to = Address(dst, m[2 * i + 1]);
    for (size_t j = 0; j < moved; ++j) {
      const int64_t from = Address(src, m[2 * j]);
      if (from < to + bytes && to < from + bytes) {
        shared.insert(Row(i, 1) + "destination block shares memory with the source block of " +
                      "block_mapping[" + std::to_string(j) + ", 0]");
      }
    }
    copies += std::to_string(Address(src, m[2 * i])) + "->" + std::to_string(to) + ":" +
              std::to_string(bytes) + " ";
  }
  return shared.empty() ? std::set<std::string>{copies} : shared;
}

// Blocks of one size, with strides of at least a block; src and dst far apart or in one
// buffer, where their blocks may overlap in part. Mostly good rows, some out of range,
// some destinations repeated.
void TestRandomMappingsMatchReference(std::mt19937_64& rng) {
  int accepted = 0, out_of_range = 0, twice = 0, shared = 0, shared_once = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int64_t bytes = rng() % 20 == 0 ? 0 : 1 + rng() % 16;
    const bool one_buffer = rng() % 2;
    const int64_t buffer = int64_t{1} << 40, spread = 3 * bytes + 1;
    const auto tensor = [&](int64_t base) {
      const int64_t stride = bytes + (rng() % 2 ? 0 : rng() % (bytes + 1));
      return Tensor(1 + rng() % 10, bytes, stride, base + (one_buffer ? rng() % spread : 0));
    };
    const BlockTensorAt src = tensor(buffer), dst = tensor(one_buffer ? buffer : 2 * buffer);
    std::vector<int64_t> unused(dst.geometry.blocks);
    for (size_t k = 0; k < unused.size(); ++k) unused[k] = static_cast<int64_t>(k);
    std::shuffle(unused.begin(), unused.end(), rng);
    Mapping m;
    const int rows = rng() % (dst.geometry.blocks + 2);
    for (int i = 0; i < rows; ++i) {
      int64_t s = rng() % src.geometry.blocks, d;
      if (rng() % 30 == 0) s = rng() % 2 ? -1 - rng() % 3 : src.geometry.blocks + rng() % 3;
      if (rng() % 30 == 0) {
        d = rng() % 2 ? -1 - rng() % 3 : dst.geometry.blocks + rng() % 3;
      } else if (unused.empty() || (i > 0 && rng() % 30 == 0)) {
        d = m[2 * (rng() % i) + 1];
      } else {
        d = unused.back();
        unused.pop_back();
      }
      m.push_back(s);
      m.push_back(d);
    }
    const std::set<std::string> want = Reference(src, dst, m);
    const std::string got = Map(src, dst, m);
    EXPECT(want.count(got) == 1);
    if (want.count(got) != 1) {
      std::fprintf(stderr, "  got  %s\n  want %s (of %zu)\n", got.c_str(), want.begin()->c_str(),
                   want.size());
    }
    if (got.find("out of range") != std::string::npos) {
      ++out_of_range;
    } else if (got.find("twice") != std::string::npos) {
      ++twice;
    } else if (got.find("shares memory") != std::string::npos) {
      ++shared;
      shared_once += want.size() == 1;
    } else {
      ++accepted;
    }
  }
  EXPECT(accepted > 2000 && out_of_range > 1000 && twice > 1000 && shared_once > 500 &&
         shared > shared_once + 1000);
}

void TestEdges() {
  const BlockTensorAt src = Tensor(4, 8, 16, 1000), dst = Tensor(3, 8, 8, 5000);
  EXPECT(Map(src, dst, {}) == "");
  EXPECT(Map(src, dst, {3, 0, 0, 2}) == "1048->5000:8 1000->5016:8 ");
  EXPECT(Map(src, dst, {0, 0, 4, 1}) ==
         "block_mapping[1, 0]: source block 4 is out of range for src with 4 blocks");
  EXPECT(Map(src, dst, {0, -1}) ==
         "block_mapping[0, 1]: destination block -1 is out of range for dst with 3 blocks");
  // The first row at fault is named, whatever its fault.
  EXPECT(Map(src, dst, {0, 2, 1, 2, 9, 0}) ==
         "block_mapping[1, 1]: destination block 2 is written twice");
  // Empty blocks: nothing to copy, but the mapping is checked as any other.
  EXPECT(Map(Tensor(4, 0, 0, 1000), Tensor(3, 0, 0, 5000), {1, 1, 2, 0}) == "");
  EXPECT(Map(Tensor(4, 0, 0, 1000), Tensor(3, 0, 0, 5000), {1, 1, 9, 9}) ==
         "block_mapping[1, 0]: source block 9 is out of range for src with 4 blocks");
  EXPECT(Map(Tensor(4, 0, 0, 1000), Tensor(3, 0, 0, 5000), {1, 1, 2, 1}) ==
         "block_mapping[1, 1]: destination block 1 is written twice");
  // Few rows over very many destination blocks: checked without a bit per block (2^40
  // blocks would be 128 GiB of bits), the first row written twice named.
  const BlockTensorAt vast = Tensor(int64_t{1} << 40, 8, 8, 5000);
  EXPECT(Map(src, vast, {0, 7, 1, int64_t{1} << 39, 2, 3, 3, 7}) ==
         "block_mapping[3, 1]: destination block 7 is written twice");
  EXPECT(Map(src, vast, {0, 7, 1, 7, 9, 0}) == "block_mapping[1, 1]: destination block 7 is written twice");
  EXPECT(Map(src, vast, {0, 7, 9, 3, 1, 7}) ==
         "block_mapping[1, 0]: source block 9 is out of range for src with 4 blocks");
  EXPECT(Map(Tensor(4, 0, 0, 1000), Tensor(int64_t{1} << 40, 0, 0, 5000), {0, 5, 1, 9, 2, 5, 3, 9}) ==
         "block_mapping[2, 1]: destination block 5 is written twice");
  // Views of one buffer: blocks that touch are fine, one shared byte is not; a source
  // block read twice is fine.
  const BlockTensorAt low = Tensor(4, 8, 8, 1000), high = Tensor(4, 8, 8, 1016);
  EXPECT(Map(low, high, {1, 0, 1, 3}) == "1008->1016:8 1008->1040:8 ");
  EXPECT(Map(low, Tensor(4, 8, 8, 1015), {1, 3, 2, 0}) ==
         "block_mapping[1, 1]: destination block shares memory with the source block of "
         "block_mapping[0, 0]");
  EXPECT(Map(low, low, {2, 1, 3, 2}) ==
         "block_mapping[1, 1]: destination block shares memory with the source block of "
         "block_mapping[0, 0]");
  // What copy_blocks' tensors never are.
  EXPECT(Map(src, Tensor(3, 4, 8, 5000), {0, 0}) == "dst: blocks of 4 bytes, but src's are 8");
  EXPECT(InvalidArgument([&] { MapBlocks(src, dst, nullptr, -1); }) == "block_mapping: -1 rows");
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(1732);
  kvoffload::TestRandomMappingsMatchReference(rng);
  kvoffload::TestEdges();
  return kvoffload::TestResult("block_mapping_test");
}
