#ifndef KVOFFLOAD_CC_COPY_BLOCK_MAPPING_H_
#define KVOFFLOAD_CC_COPY_BLOCK_MAPPING_H_

// copy_blocks' mapping of source to destination blocks, checked (ids in range, no
// destination written twice or overlapping its source) and turned into a CopyBatch.

#include <cstdint>
#include <vector>

#include "cc/copy/block_geometry.h"
#include "cc/copy/copy_batch.h"

namespace kvoffload {

// A tensor's blocks in memory: block i is at address base + i * geometry.stride_bytes.
struct BlockTensorAt {
  BlockGeometry geometry;
  int64_t base = 0;
};

// The copies of a block mapping, one per row, as a CopyBatch's arrays.
struct BlockCopies {
  std::vector<int64_t> src, dst, size;

  int64_t count() const { return static_cast<int64_t>(size.size()); }
  // order: one SrcAccessOrder per copy, or nullptr.
  CopyBatch Batch(const uint8_t* order = nullptr) const {
    return CopyBatch{src.data(), dst.data(), size.data(), count(), order};
  }
};

// One copy of block mapping[2 * i] of src to block mapping[2 * i + 1] of dst for each
// i < rows, none when blocks are empty. Throws std::invalid_argument naming the first
// row at fault ("block_mapping[3, 1]: ..."): a block out of range, a destination block
// written twice, or one that shares bytes with a source block (src and dst may be views
// of one buffer; the copies run in parallel, so such a block would be torn). src's and
// dst's blocks must be of one size.
BlockCopies MapBlocks(const BlockTensorAt& src, const BlockTensorAt& dst,
                      const int64_t* mapping, int64_t rows);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_BLOCK_MAPPING_H_
