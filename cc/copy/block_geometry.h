#ifndef KVOFFLOAD_CC_COPY_BLOCK_GEOMETRY_H_
#define KVOFFLOAD_CC_COPY_BLOCK_GEOMETRY_H_

// A tensor seen as blocks along dim 0 (its DLPack shape and strides, checked), for
// copy_blocks (block_mapping.h).

#include <cstdint>
#include <string>
#include <vector>

namespace kvoffload {

// A tensor seen as blocks along dim 0: block i starts i * stride_bytes after block 0.
struct BlockGeometry {
  int64_t blocks = 0;
  int64_t block_bytes = 0;  // the bytes of dims 1 and up
  int64_t stride_bytes = 0;
};

// The geometry of a tensor of `shape` and `strides` (in elements) whose elements are
// `itemsize` bytes. Each block (dims 1 and up) must be contiguous, size-1 dims aside,
// unless the tensor is empty; blocks may not overlap. Throws std::invalid_argument
// naming `name` ("src: blocks overlap ...").
BlockGeometry BlockGeometryOf(const std::vector<int64_t>& shape,
                              const std::vector<int64_t>& strides, int64_t itemsize,
                              const std::string& name);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_BLOCK_GEOMETRY_H_
