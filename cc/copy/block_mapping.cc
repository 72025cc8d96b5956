#include "cc/copy/block_mapping.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
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
  // Every row is checked, zero-byte blocks too. A destination written twice is found by
  // a bit per destination block where they are few beside the rows, else by sorting.
  const bool dense = dst.geometry.blocks <= 8 * rows + 1024;
  std::vector<bool> written(dense ? dst.geometry.blocks : 0, false);
  std::vector<std::pair<int64_t, int64_t>> sparse;  // (destination block, row)
  // The first row at fault is named, whatever its fault: with sparse checks a row written
  // twice is found after the loop, so a fault past it waits until then.
  int64_t fault_row = rows;
  std::string fault;
  for (int64_t i = 0; i < rows && fault_row == rows; ++i) {
    const int64_t s = mapping[2 * i], d = mapping[2 * i + 1];
    if (s < 0 || s >= src.geometry.blocks) {
      fault_row = i;
      fault = "0source block " + std::to_string(s) + " is out of range for src with " +
              std::to_string(src.geometry.blocks) + " blocks";
    } else if (d < 0 || d >= dst.geometry.blocks) {
      fault_row = i;
      fault = "1destination block " + std::to_string(d) + " is out of range for dst with " +
              std::to_string(dst.geometry.blocks) + " blocks";
    } else if (dense) {
      if (written[d]) {
        fault_row = i;
        fault = "1destination block " + std::to_string(d) + " is written twice";
      }
      written[d] = true;
    } else {
      sparse.emplace_back(d, i);
    }
  }
  std::sort(sparse.begin(), sparse.end());
  for (size_t k = 1; k < sparse.size(); ++k) {
    if (sparse[k].first == sparse[k - 1].first && sparse[k].second < fault_row) {
      fault_row = sparse[k].second;
      fault = "1destination block " + std::to_string(sparse[k].first) + " is written twice";
    }
  }
  if (fault_row < rows) Reject(fault_row, fault[0] - '0', fault.substr(1));
  const int64_t count = block_bytes == 0 ? 0 : rows;
  BlockCopies copies{std::vector<int64_t>(count), std::vector<int64_t>(count),
                     std::vector<int64_t>(count, block_bytes)};
  for (int64_t i = 0; i < count; ++i) {
    copies.src[i] = src.base + mapping[2 * i] * src.geometry.stride_bytes;
    copies.dst[i] = dst.base + mapping[2 * i + 1] * dst.geometry.stride_bytes;
  }
  RefuseAliasing(copies, block_bytes);
  return copies;
}

}  // namespace kvoffload
