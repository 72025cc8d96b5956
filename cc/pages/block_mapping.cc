#include "cc/pages/block_mapping.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvoffload {
namespace {

[[noreturn]] void Reject(int64_t row, int column, const std::string& what) {
  throw std::invalid_argument("block_mapping[" + std::to_string(row) + ", " +
                              std::to_string(column) + "]: " + what);
}

void RefuseAliasing(const BlockCopies& copies, int64_t block_bytes) {
  struct Block {
    int64_t start, row;
    bool is_dst;
  };
  std::vector<Block> blocks;
  blocks.reserve(2 * copies.count());
  for (int64_t i = 0; i < copies.count(); ++i) {
    blocks.push_back({copies.src[i], i, false});
    blocks.push_back({copies.dst[i], i, true});
  }
  std::sort(blocks.begin(), blocks.end(),
            [](const Block& a, const Block& b) { return a.start < b.start; });
  Block last[2] = {{0, -1, false}, {0, -1, true}};  // the last source and destination seen
  for (const Block& b : blocks) {
    const Block& other = last[!b.is_dst];
    if (other.row >= 0 && other.start + block_bytes > b.start) {
      const int64_t d = b.is_dst ? b.row : other.row, s = b.is_dst ? other.row : b.row;
      Reject(d, 1, "destination block shares memory with the source block of block_mapping[" +
                       std::to_string(s) + ", 0]");
    }
    last[b.is_dst] = b;
  }
}

}  // namespace

BlockCopies MapBlocks(const BlockTensorAt& src, const BlockTensorAt& dst,
                      const int64_t* mapping, int64_t rows) {
  const int64_t block_bytes = src.geometry.block_bytes;
  if (dst.geometry.block_bytes != block_bytes) {
    throw std::invalid_argument("dst: blocks of " + std::to_string(dst.geometry.block_bytes) +
                                " bytes, but src's are " + std::to_string(block_bytes));
  }
  if (rows < 0) throw std::invalid_argument("block_mapping: " + std::to_string(rows) + " rows");
  const int64_t count = block_bytes == 0 ? 0 : rows;
  BlockCopies copies{std::vector<int64_t>(count), std::vector<int64_t>(count),
                     std::vector<int64_t>(count, block_bytes)};
  std::vector<bool> written(dst.geometry.blocks, false);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t s = mapping[2 * i], d = mapping[2 * i + 1];
    if (s < 0 || s >= src.geometry.blocks) {
      Reject(i, 0, "source block " + std::to_string(s) + " is out of range for src with " +
                       std::to_string(src.geometry.blocks) + " blocks");
    }
    if (d < 0 || d >= dst.geometry.blocks) {
      Reject(i, 1, "destination block " + std::to_string(d) + " is out of range for dst with " +
                       std::to_string(dst.geometry.blocks) + " blocks");
    }
    if (written[d]) Reject(i, 1, "destination block " + std::to_string(d) + " is written twice");
    written[d] = true;
    copies.src[i] = src.base + s * src.geometry.stride_bytes;
    copies.dst[i] = dst.base + d * dst.geometry.stride_bytes;
  }
  RefuseAliasing(copies, block_bytes);
  return copies;
}

}  // namespace kvoffload
