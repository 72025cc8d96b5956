#include "cc/copy_pieces.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvoffload {

int64_t SplitIntoPieces(const CopyBatch& batch, int64_t piece_bytes, std::vector<int64_t>& out) {
  int64_t count = 0;
  for (int64_t i = 0; i < batch.count; ++i) count += (batch.size[i] + piece_bytes - 1) / piece_bytes;
  out.resize(3 * count);
  int64_t* src = out.data();
  int64_t* dst = src + count;
  int64_t* size = dst + count;
  int64_t k = 0;
  for (int64_t i = 0; i < batch.count; ++i) {
    for (int64_t offset = 0; offset < batch.size[i]; offset += piece_bytes, ++k) {
      src[k] = batch.src[i] + offset;
      dst[k] = batch.dst[i] + offset;
      size[k] = std::min(piece_bytes, batch.size[i] - offset);
    }
  }
  return count;
}

}  // namespace kvoffload
