#include "cc/copy/block_geometry.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvoffload {

BlockGeometry BlockGeometryOf(const std::vector<int64_t>& shape,
                              const std::vector<int64_t>& strides, int64_t itemsize,
                              const std::string& name) {
  const auto reject = [&name](const std::string& what) {
    throw std::invalid_argument(name + ": " + what);
  };
  if (strides.size() != shape.size()) {
    reject("has " + std::to_string(strides.size()) + " strides for " +
           std::to_string(shape.size()) + " dims");
  }
  if (itemsize < 0) reject("item size must be >= 0, got " + std::to_string(itemsize));
  if (shape.empty()) reject("needs a block dimension");
  // Every element count, the whole tensor's included, must fit in int64.
  int64_t size = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] < 0) reject("dim " + std::to_string(d) + " is negative");
    if (__builtin_mul_overflow(size, shape[d], &size)) reject("has too many elements");
  }
  int64_t elements = 1;
  for (size_t d = shape.size(); d-- > 1;) {
    if (size > 0 && shape[d] != 1 && strides[d] != elements) {
      reject("each block (dims 1 and up) must be contiguous");
    }
    elements *= shape[d];
  }
  BlockGeometry geometry;
  geometry.blocks = shape[0];
  if (geometry.blocks > 1 && elements > 0 && strides[0] < 0) {
    reject("has a negative dim-0 stride (" + std::to_string(strides[0]) +
           "; a reversed view): blocks must go forwards");
  }
  if (geometry.blocks > 1 && elements > 0 && strides[0] < elements) {
    reject("blocks overlap (dim-0 stride " + std::to_string(strides[0]) + " < block size " +
           std::to_string(elements) + " elements)");
  }
  if (__builtin_mul_overflow(elements, itemsize, &geometry.block_bytes) ||
      __builtin_mul_overflow(strides[0], itemsize, &geometry.stride_bytes)) {
    reject("has too many bytes");
  }
  return geometry;
}

}  // namespace kvoffload
