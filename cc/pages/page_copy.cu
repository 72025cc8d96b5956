#include "cc/pages/page_copy.h"

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "cc/copy/batch_copy.h"
#include "cc/copy/staging_ring.h"
#include "cc/copy/stream_upload.h"
#include "cc/copy/warp_copy.h"
#include "cc/cuda/capture_mode.h"
#include "cc/cuda/cuda_check.h"
#include "cc/cuda/driver_symbol.h"
#include "cc/cuda/load_kernel.h"
#include "cc/cuda/stream_device.h"
#include "cc/memory/memory_reach.h"
#include "cc/pages/page_address.h"

namespace kvoffload {
namespace {

constexpr int kThreads = 1024;

// Each warp takes a contiguous share of units [first_unit, end_unit), one unit at a
// time, finding its first unit's segment by binary search and the rest by walking on.
// The host side of a unit is the slot at `slot` (holding the job's bytes from
// slot_first_byte on) or, when slot is 0, the host address its segment gives.
__global__ void __launch_bounds__(kThreads)
    PageCopyKernel(const TensorRef* refs, const int64_t* block_ids, const Segment* segments,
                   int64_t num_segments, int64_t first_unit, int64_t end_unit, int64_t slot,
                   int64_t slot_first_byte, Direction direction) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / kWarpSize);
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kWarpSize;
  const int64_t share = (end_unit - first_unit + warps - 1) / warps;
  const int64_t begin = first_unit + warp * share;
  const int64_t end = begin + share < end_unit ? begin + share : end_unit;
  if (begin >= end) return;
  int64_t k = FindSegment(segments, num_segments, begin);
  for (int64_t u = begin; u < end; ++u) {
    while (k + 1 < num_segments && segments[k + 1].first_unit <= u) ++k;
    const Segment& s = segments[k];
    const UnitPlace p = PlaceUnit(refs[s.ref], block_ids, s, u - s.first_unit);
    const int64_t host = slot != 0 ? slot + (p.job_byte - slot_first_byte)
                                   : s.host + (p.job_byte - s.first_byte);
    char* gpu = reinterpret_cast<char*>(p.gpu);
    char* other = reinterpret_cast<char*>(host);
    if (direction == Direction::kLoad) {
      WarpCopy(other, gpu, p.bytes, lane);
    } else {
      WarpCopy(gpu, other, p.bytes, lane);
    }
  }
}

// The job's block ids (array 0) and segments (array 1) in device memory.
StreamUpload UploadJob(const PageJob& job, const std::vector<Segment>& segments,
                       cudaStream_t stream) {
  return StreamUpload({{job.block_ids, job.num_block_ids * sizeof(int64_t)},
                       {segments.data(), segments.size() * sizeof(Segment)}},
                      stream);
}

void Launch(const DevicePageTable& table, const StreamUpload& job, int64_t segments,
            int64_t first_unit, int64_t end_unit, int64_t slot, int64_t slot_first_byte,
            Direction direction, int max_ctas, cudaStream_t stream) {
  const int64_t warps = end_unit - first_unit;
  const int ctas = static_cast<int>(
      std::min<int64_t>(max_ctas, (warps + kThreads / kWarpSize - 1) / (kThreads / kWarpSize)));
  PageCopyKernel<<<ctas, kThreads, 0, stream>>>(table.device_refs(), job.array<int64_t>(0),
                                                job.array<Segment>(1), segments, first_unit,
                                                end_unit, slot, slot_first_byte, direction);
  CheckCuda(cudaGetLastError(), "page copy kernel launch");
}

// The DMA between a slot and the host runs of its slice.
struct SliceDma {
  std::vector<int64_t> src, dst, size;
};

SliceDma MakeDma(const HostRuns& runs, int64_t slot, Direction direction) {
  SliceDma dma;
  dma.size = runs.size;
  std::vector<int64_t> slot_addresses(runs.slot.size());
  for (size_t i = 0; i < runs.slot.size(); ++i) slot_addresses[i] = slot + runs.slot[i];
  HostOf(direction, dma.src, dma.dst) = runs.host;
  DeviceOf(direction, dma.src, dma.dst) = std::move(slot_addresses);
  return dma;
}

int64_t EnqueueDma(const SliceDma& dma, Direction direction, cudaStream_t stream) {
  return StagingDma(CopyBatch{dma.src.data(), dma.dst.data(), dma.size.data(),
                              static_cast<int64_t>(dma.size.size())},
                    direction, stream);
}

void StagedPageCopy(const DevicePageTable& table, const PageJob& job, Direction direction,
                    const std::vector<Segment>& segments, int64_t units, int device,
                    cudaStream_t stream, const PageCopyOptions& options, CopyResult& result) {
  const PageLayout& layout = table.layout();
  const std::vector<PageSlice> slices = CutSlices(layout, segments, units, options.slot_bytes);
  std::vector<HostRuns> runs(slices.size());
  for (size_t i = 0; i < slices.size(); ++i) SliceHostRuns(layout, segments, slices[i], runs[i]);

  StagingRing& ring = StagingRing::For(device, direction, options.slot_bytes, options.slots, options.ring,
                                       options.slots_in_l2);
  std::lock_guard<std::mutex> lock(ring.mutex());
  ring.Run(stream, [&] {
    const StreamUpload upload = UploadJob(job, segments, ring.kernel_stream());
    const int64_t count = static_cast<int64_t>(segments.size());
    for (size_t i = 0; i < slices.size(); ++i) {
      const StagingRing::Slot slot = ring.Next();
      const SliceDma dma = MakeDma(runs[i], slot.address, direction);
      auto kernel = [&](cudaStream_t s) {
        Launch(table, upload, count, slices[i].first_unit, slices[i].end_unit, slot.address,
               slices[i].first_byte, direction, options.max_ctas, s);
      };
      auto copy = [&](cudaStream_t s) { result.driver_calls += EnqueueDma(dma, direction, s); };
      ring.Stage(slot, direction, copy, kernel);
      ++result.driver_calls;  // the kernel
    }
  });
}

struct Batch3D {
  PFN_cuMemcpy3DBatchAsync_v13000 v13000 = nullptr;
  PFN_cuMemcpy3DBatchAsync_v12080 v12080 = nullptr;  // adds failIdx
};

const Batch3D& Batch3DApi() {
  static const Batch3D api = [] {
    Batch3D a;
    a.v13000 = reinterpret_cast<PFN_cuMemcpy3DBatchAsync_v13000>(ResolveDriverSymbol("cuMemcpy3DBatchAsync", 13000));
    if (a.v13000 == nullptr) {
      a.v12080 =
          reinterpret_cast<PFN_cuMemcpy3DBatchAsync_v12080>(ResolveDriverSymbol("cuMemcpy3DBatchAsync", 12080));
    }
    return a;
  }();
  return api;
}

CUmemcpy3DOperand PitchedOperand(int64_t address, int64_t pitch) {
  CUmemcpy3DOperand operand{};
  operand.type = CU_MEMCPY_OPERAND_TYPE_POINTER;
  operand.op.ptr.ptr = static_cast<CUdeviceptr>(address);
  operand.op.ptr.rowLength = static_cast<size_t>(pitch);  // elements of one byte
  operand.op.ptr.layerHeight = 0;                         // one layer
  operand.op.ptr.locHint.type = CU_MEM_LOCATION_TYPE_INVALID;
  return operand;
}

// The row copies kCopiesPerDriverCall to a cuMemcpy3DBatchAsync call; returns the calls,
// or -1 where the driver has no such call (nothing enqueued).
int64_t EnqueueRowBatches(const DevicePageTable& table, const RowCopies& copies, Direction direction,
                          cudaStream_t stream, bool prefer_overlap) {
  const Batch3D& api = Batch3DApi();
  if (api.v13000 == nullptr && api.v12080 == nullptr) return -1;
  thread_local std::vector<CUDA_MEMCPY3D_BATCH_OP> ops;
  const bool store = direction == Direction::kStore;
  const int64_t n = static_cast<int64_t>(copies.gpu.size());
  int64_t calls = 0;
  for (int64_t first = 0; first < n; first += kCopiesPerDriverCall) {
    const int64_t end = std::min(n, first + kCopiesPerDriverCall);
    ops.assign(static_cast<size_t>(end - first), CUDA_MEMCPY3D_BATCH_OP{});
    for (int64_t i = first; i < end; ++i) {
      const GroupRows& r = table.rows()[copies.group[i]];
      CUDA_MEMCPY3D_BATCH_OP& op = ops[i - first];
      const CUmemcpy3DOperand gpu = PitchedOperand(copies.gpu[i], r.gpu_pitch);
      const CUmemcpy3DOperand host = PitchedOperand(copies.host[i], r.host_pitch);
      op.src = store ? gpu : host;
      op.dst = store ? host : gpu;
      op.extent = CUextent3D{static_cast<size_t>(copies.width[i]), static_cast<size_t>(copies.rows[i]), 1};
      op.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
      if (prefer_overlap) op.flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE;
    }
    size_t fail = 0;
    const CUresult status =
        api.v13000 != nullptr
            ? api.v13000(ops.size(), ops.data(), 0, reinterpret_cast<CUstream>(stream))
            : api.v12080(ops.size(), ops.data(), &fail, 0, reinterpret_cast<CUstream>(stream));
    if (status != CUDA_SUCCESS) {
      throw CudaError("cuMemcpy3DBatchAsync", DriverErrorName(status), static_cast<int>(status), first,
                      "row copies " + std::to_string(first) + " to " + std::to_string(end - 1) +
                          "; the job's other DMA and the " + std::to_string(first) +
                          " row copies before them were enqueued");
    }
    ++calls;
  }
  return calls;
}

// The strided groups' row copies, one cudaMemcpy2DAsync each, or in batches
// (PageCopyOptions::row_batches); returns the driver calls.
int64_t EnqueueRows(const DevicePageTable& table, const RowCopies& copies, Direction direction,
                    cudaStream_t stream, bool batches, bool prefer_overlap) {
  // The batch calls take no legacy stream.
  if (batches && stream != nullptr && stream != cudaStreamLegacy && !copies.gpu.empty()) {
    const int64_t calls = EnqueueRowBatches(table, copies, direction, stream, prefer_overlap);
    if (calls >= 0) return calls;
  }
  for (size_t i = 0; i < copies.gpu.size(); ++i) {
    const GroupRows& r = table.rows()[copies.group[i]];
    const bool store = direction == Direction::kStore;
    const int64_t src = store ? copies.gpu[i] : copies.host[i];
    const int64_t dst = store ? copies.host[i] : copies.gpu[i];
    const cudaError_t status =
        cudaMemcpy2DAsync(reinterpret_cast<void*>(dst), store ? r.host_pitch : r.gpu_pitch,
                          reinterpret_cast<const void*>(src), store ? r.gpu_pitch : r.host_pitch,
                          copies.width[i], copies.rows[i], cudaMemcpyDefault, stream);
    if (status != cudaSuccess) {
      cudaGetLastError();
      throw CudaError("cudaMemcpy2DAsync", cudaGetErrorName(status), status, -1,
                      "row copy " + std::to_string(i) + " of group " + std::to_string(copies.group[i]) +
                          " (" + std::to_string(copies.width[i]) + " bytes x " + std::to_string(copies.rows[i]) +
                          " rows, GPU pitch " + std::to_string(r.gpu_pitch) + ", host pitch " +
                          std::to_string(r.host_pitch) + "): " + cudaGetErrorString(status) +
                          "; the job's other DMA and the " + std::to_string(i) +
                          " row copies before this one were enqueued");
    }
  }
  return static_cast<int64_t>(copies.gpu.size());
}

bool AnyStrided(const DevicePageTable& table) {
  for (const GroupRows& r : table.rows()) {
    if (r.strided) return true;
  }
  return false;
}

// Row copies read in stream order whatever src_order says: stricter than kAny, so never
// wrong.
CopyResult DmaPageCopy(const DevicePageTable& table, const PageJob& job, Direction direction,
                       const std::vector<Segment>& segments, cudaStream_t stream, int64_t bytes,
                       const PageCopyOptions& options) {
  const PageLayout& layout = table.layout();
  thread_local PageDma dma, row_pages;
  thread_local RowCopies rows;
  thread_local std::vector<Segment> rest;
  thread_local std::vector<uint8_t> order;
  const bool strided = options.strided && AnyStrided(table);
  if (strided) {
    row_pages.gpu.clear();
    row_pages.host.clear();
    row_pages.size.clear();
    BuildRowCopies(layout, table.rows(), job.block_ids, segments, direction, options.rows_per_copy, rows,
                   row_pages, rest);
    BuildPageDma(layout, job.block_ids, rest, direction, dma);
    dma.gpu.insert(dma.gpu.end(), row_pages.gpu.begin(), row_pages.gpu.end());
    dma.host.insert(dma.host.end(), row_pages.host.begin(), row_pages.host.end());
    dma.size.insert(dma.size.end(), row_pages.size.begin(), row_pages.size.end());
  } else {
    BuildPageDma(layout, job.block_ids, segments, direction, dma);
  }
  CopyBatch batch;
  HostOf(direction, batch.src, batch.dst) = dma.host.data();
  DeviceOf(direction, batch.src, batch.dst) = dma.gpu.data();
  batch.size = dma.size.data();
  batch.count = static_cast<int64_t>(dma.size.size());
  batch.prefer_overlap = options.prefer_overlap;
  if (options.src_order != SrcAccessOrder::kStream) {
    order.assign(dma.size.size(), static_cast<uint8_t>(options.src_order));
    batch.order = order.data();
  }
  CopyResult result = BatchCopy(batch, stream);
  if (strided) {
    result.driver_calls += EnqueueRows(table, rows, direction, stream, options.row_batches,
                                       options.prefer_overlap);
    result.copies += static_cast<int64_t>(rows.gpu.size());
    if (batch.count == 0) result.reason = PathReason::kStridedRows;
  }
  result.bytes = bytes;
  return result;
}

// Whether each group's tensors are rows of one copy: by their addresses, the device's
// largest pitch, and the driver's word that every row lies in one GPU allocation (under
// PyTorch's expandable segments a range is one mapped handle: refused). The host side
// needs no check: BuildRowCopies cuts copies at the pool's registration edges.
std::vector<GroupRows> RowsOf(const PageLayout& layout, int device) {
  int max_pitch = 0;
  CheckCuda(cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, device),
            "cudaDeviceGetAttribute(cudaDevAttrMaxPitch)");
  std::vector<GroupRows> rows;
  for (int64_t g = 0; g < layout.groups(); ++g) {
    GroupRows r = GroupRowsOf(layout, g);
    const int64_t first = layout.first_ref(g), last = layout.end_ref(g) - 1;
    if (r.strided && std::max(r.gpu_pitch, r.host_pitch) > max_pitch) {
      r.strided = false;
      r.why_not = "a pitch of " + std::to_string(std::max(r.gpu_pitch, r.host_pitch)) +
                  " bytes exceeds the device's maximum, " + std::to_string(max_pitch);
    }
    if (r.strided && layout.gpu_blocks(g) > 0) {
      const int64_t begin = layout.refs()[first].gpu_base;
      const int64_t end = layout.refs()[last].gpu_base + layout.gpu_span(last);
      const PointerAttributes a = AskDriver(begin);
      if (a.range_size <= 0 || a.range_start > begin || a.range_start + a.range_size < end) {
        r.strided = false;
        r.why_not = "the GPU tensors are not one allocation";
      }
    }
    rows.push_back(std::move(r));
  }
  return rows;
}

}  // namespace

DevicePageTable::DevicePageTable(PageLayout layout, int device)
    : layout_(std::move(layout)), device_(device) {
  RequireCudaDevice();
  // Every page lies inside its ref's span, so the spans' ends decide what a kernel
  // on this device can reach.
  std::vector<int64_t> gpu, cpu, gpu_span, cpu_span;
  for (size_t r = 0; r < layout_.refs().size(); ++r) {
    if (layout_.gpu_span(r) > 0) {
      gpu.push_back(layout_.refs()[r].gpu_base);
      gpu_span.push_back(layout_.gpu_span(r));
    }
    if (layout_.cpu_span(r) > 0) {
      cpu.push_back(layout_.refs()[r].cpu_base);
      cpu_span.push_back(layout_.cpu_span(r));
    }
  }
  RequireReachable(gpu.data(), gpu_span.data(), static_cast<int64_t>(gpu.size()), device,
                   Reach::kDevice, "gpu_base");
  RequireReachable(cpu.data(), cpu_span.data(), static_cast<int64_t>(cpu.size()), device,
                   Reach::kPinnedHost, "cpu_base");
  rows_ = RowsOf(layout_, device);
  DeviceGuard guard(device);
  const size_t bytes = std::max<size_t>(1, layout_.refs().size()) * sizeof(TensorRef);
  cudaError_t status = cudaMalloc(&refs_, bytes);
  if (status == cudaSuccess && !layout_.refs().empty()) {
    status = cudaMemcpy(refs_, layout_.refs().data(), layout_.refs().size() * sizeof(TensorRef),
                        cudaMemcpyHostToDevice);
  }
  if (status != cudaSuccess && refs_ != nullptr) cudaFree(refs_);
  CheckCuda(status, "page table upload (cudaMalloc, cudaMemcpy)");
}

DevicePageTable::~DevicePageTable() {
  try {
    DeviceGuard guard(device_);
    const RelaxedCaptureMode relaxed;  // a handler collected while another thread captures
    cudaFree(refs_);  // waits for the kernels that may still read the refs
  } catch (...) {
  }
}

void LoadPageCopyKernel() {
  LoadKernel(PageCopyKernel, "cudaFuncGetAttributes(page copy kernel)");
}

void ValidatePageCopyOptions(const PageCopyOptions& options) {
  if (options.max_ctas < 1) {
    throw std::invalid_argument("max_ctas: must be >= 1, got " + std::to_string(options.max_ctas));
  }
  if (options.slot_bytes < kPageUnitBytes || options.slot_bytes > kMaxSlotBytes ||
      options.slot_bytes % 256 != 0) {
    throw std::invalid_argument("slot_bytes: must be a multiple of 256 in [" +
                                std::to_string(kPageUnitBytes) + ", " + std::to_string(kMaxSlotBytes) +
                                "], got " + std::to_string(options.slot_bytes));
  }
  if (options.slots < 2 || options.slots > kMaxSlots) {
    throw std::invalid_argument("slots: must be in [2, " + std::to_string(kMaxSlots) + "], got " +
                                std::to_string(options.slots));
  }
  if (options.src_order != SrcAccessOrder::kStream && options.src_order != SrcAccessOrder::kAny) {
    throw std::invalid_argument("src_order: must be STREAM or ANY, got " +
                                std::to_string(static_cast<int>(options.src_order)));
  }
  if (options.rows_per_copy < 0) {
    throw std::invalid_argument("rows_per_copy: must be >= 0 (0: all of a group's rows), got " +
                                std::to_string(options.rows_per_copy));
  }
  if (options.ring < 0 || options.ring >= kMaxRings) {
    throw std::invalid_argument("ring: must be in [0, " + std::to_string(kMaxRings) + "), got " +
                                std::to_string(options.ring));
  }
}

CopyResult PageCopy(const DevicePageTable& table, const PageJob& job, Direction direction,
                    cudaStream_t stream, const PageCopyOptions& options, bool validated) {
  ValidatePageCopyOptions(options);
  if (options.src_order != SrcAccessOrder::kStream && !(direction == Direction::kLoad && options.path == PagePath::kDma)) {
    throw std::invalid_argument("src_order: ANY is for DMA loads only (a store's source is the live "
                                "GPU cache; the ring and the kernel read in stream order)");
  }
  if (!validated) ValidateJob(table.layout(), job);
  thread_local std::vector<Segment> segments;
  const int64_t units = BuildSegments(table.layout(), job, segments);
  CopyResult result;
  result.reason = options.path == PagePath::kStaged ? PathReason::kStagedRequested
                                                   : PathReason::kKernelRequested;
  result.copies = units;
  result.bytes = SegmentBytes(table.layout(), segments);
  if (units == 0) {
    result.reason = PathReason::kEmptyBatch;
    return result;
  }
  RequireCudaDevice();
  StreamDeviceGuard guard(stream);
  if (guard.device() != table.device()) {
    throw std::invalid_argument("stream: is on device " + std::to_string(guard.device()) +
                                " but the page table is on device " +
                                std::to_string(table.device()));
  }
  if (options.path == PagePath::kDma) {
    return DmaPageCopy(table, job, direction, segments, stream, result.bytes, options);
  }
  if (options.path == PagePath::kStaged) {
    StagedPageCopy(table, job, direction, segments, units, guard.device(), stream, options, result);
    return result;
  }
  const StreamUpload upload = UploadJob(job, segments, stream);
  Launch(table, upload, static_cast<int64_t>(segments.size()), 0, units, 0, 0, direction,
         options.max_ctas, stream);
  result.driver_calls = 1;
  return result;
}

}  // namespace kvoffload
