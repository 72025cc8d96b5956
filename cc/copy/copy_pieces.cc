#include "cc/copy/copy_pieces.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvoffload {

int64_t SplitIntoPieces(const CopyBatch& batch, int64_t piece_bytes, std::vector<int64_t>& out) {
  int64_t count = 0;
  // Rounded up without size + piece_bytes - 1, which passes INT64_MAX for huge pieces.
  for (int64_t i = 0; i < batch.count; ++i) {
    count += batch.size[i] / piece_bytes + (batch.size[i] % piece_bytes != 0);
  }
  out.resize(3 * count);
  int64_t* src = out.data();
  int64_t* dst = src + count;
  int64_t* size = dst + count;
  int64_t k = 0;
  for (int64_t i = 0; i < batch.count; ++i) {
    for (int64_t offset = 0; offset < batch.size[i]; ++k) {
      src[k] = batch.src[i] + offset;
      dst[k] = batch.dst[i] + offset;
      size[k] = std::min(piece_bytes, batch.size[i] - offset);
      offset += size[k];  // never past the copy's size, so never past INT64_MAX
    }
  }
  return count;
}

}  // namespace kvoffload
