#ifndef KVOFFLOAD_CC_COPY_COPY_PIECES_H_
#define KVOFFLOAD_CC_COPY_COPY_PIECES_H_

// Copies cut into pieces of at most a given size, for the copy kernel's warps.

#include <cstdint>
#include <vector>

#include "cc/copy/copy_batch.h"

namespace kvoffload {

// Splits the copies of a valid batch (ValidateCopyBatch) into pieces of at most
// piece_bytes > 0, in copy order; every piece but a copy's last is piece_bytes long, so
// offsets stay aligned to it. Writes arrays [src..., dst..., size...] of 3 * count
// entries to `out` (resized) and returns count.
int64_t SplitIntoPieces(const CopyBatch& batch, int64_t piece_bytes, std::vector<int64_t>& out);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_COPY_PIECES_H_
