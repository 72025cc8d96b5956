#ifndef KVOFFLOAD_CC_PAGES_PAGE_COPY_H_
#define KVOFFLOAD_CC_PAGES_PAGE_COPY_H_

// The page table's copies on a device: a job's pages moved by DMA (per page, or as 2D
// copies by rows) or through the staging ring with addresses computed on the GPU.
// kvoffload._C.PageTable's copy calls.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cc/copy/copy_batch.h"
#include "cc/copy/copy_path.h"
#include "cc/copy/direction.h"
#include "cc/pages/page_dma.h"
#include "cc/pages/page_job.h"
#include "cc/pages/page_layout.h"
#include "cc/pages/row_copies.h"
#include "cc/pages/segments.h"

namespace kvoffload {

// A PageLayout whose TensorRefs live on one device, uploaded once.
class DevicePageTable {
 public:
  // Uploads the refs to `device`'s memory (synchronously).
  DevicePageTable(PageLayout layout, int device);
  ~DevicePageTable();
  DevicePageTable(const DevicePageTable&) = delete;
  DevicePageTable& operator=(const DevicePageTable&) = delete;

  const PageLayout& layout() const { return layout_; }
  int device() const { return device_; }
  const TensorRef* device_refs() const { return refs_; }
  // Per group: whether its tensors are rows of one copy (GroupRowsOf), and on the GPU
  // side lie in one allocation (a 2D copy may not span two).
  const std::vector<GroupRows>& rows() const { return rows_; }

 private:
  PageLayout layout_;
  std::vector<GroupRows> rows_;
  int device_;
  TensorRef* refs_ = nullptr;
};

// How a page job crosses the link.
enum class PagePath : uint8_t {
  // Host runs by DMA through a device staging ring; a kernel scatters (loads) or
  // gathers (stores) the HBM side.
  kStaged,
  // A kernel reads or writes the page-locked host memory itself.
  kKernel,
  // Every page (pages that follow each other merged) by cuMemcpyBatchAsync: no SM work,
  // host work per page (BuildPageDma). With `strided`, groups whose tensors are rows
  // of one allocation move a block, or a run of blocks, per 2D copy (BuildRowCopies).
  kDma,
};

struct PageCopyOptions {
  PagePath path = PagePath::kStaged;
  int max_ctas = 32;                       // CTAs of 1024 threads for the kernel
  int64_t slot_bytes = int64_t{64} << 20;  // one DMA slice
  int slots = 2;
  bool slots_in_l2 = false;  // the slots held in persisting L2 (StagingRing)
  // Which of the device's rings of this direction and geometry: copies on different
  // rings never queue behind each other's (expedited loads take a ring of their own).
  int ring = 0;
  // The DMA path's source reads: kStream, or kAny where no write to the job's source is
  // unfinished (the driver may then read it before the stream's earlier work is done).
  // The other paths read in stream order.
  SrcAccessOrder src_order = SrcAccessOrder::kStream;
  // The DMA path moves strided groups by 2D copies (DevicePageTable::rows).
  bool strided = true;
  // Those 2D copies go kCopiesPerDriverCall to a cuMemcpy3DBatchAsync call, where the
  // driver has it and the stream is not the legacy one; else a cudaMemcpy2DAsync each.
  // A study until the meter says which costs a model less.
  bool row_batches = false;
  // Rows a 2D copy spans: 0, all of its group's; else bands of that many rows, each
  // group's copies band by band and by GPU address within one (BuildRowCopies).
  int64_t rows_per_copy = 0;
  // The DMA path's copies (batch and 2D batch calls) carry the driver's hint to overlap
  // with compute (CopyBatch::prefer_overlap): a study until measured beside a model.
  bool prefer_overlap = false;
};

inline constexpr int kMaxRings = 4;  // each ring holds slots x slot_bytes of device memory
inline constexpr int kMaxSlots = 1 << 10;
inline constexpr int64_t kMaxSlotBytes = int64_t{1} << 40;

// Moves the job's pages between the table's GPU blocks and CPU chunks on `stream`, in
// stream order. The job is validated first (ValidateJob); nothing is
// enqueued if it fails. The host work is per segment; addresses are computed on the GPU.
// The table's memory must be device memory of the stream's device and page-locked host
// memory (its caller checks this once, when the table is made).
// `validated`: the caller has just run ValidateJob on this very job.
CopyResult PageCopy(const DevicePageTable& table, const PageJob& job, Direction direction,
                    cudaStream_t stream, const PageCopyOptions& options = {},
                    bool validated = false);

// Loads the page copy's kernel into the current device's context now (LoadKernel).
void LoadPageCopyKernel();

// Throws std::invalid_argument for options no copy can run with.
void ValidatePageCopyOptions(const PageCopyOptions& options);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_PAGES_PAGE_COPY_H_
