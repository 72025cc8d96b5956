#include "cc/copy/batch_copy.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/cuda/cuda_check.h"
#include "cc/cuda/cuda_error.h"
#include "cc/cuda/driver_symbol.h"
#include "cc/cuda/stream_device.h"

namespace kvoffload {
namespace {

static_assert(sizeof(CUdeviceptr) == sizeof(int64_t) && sizeof(size_t) == sizeof(int64_t),
              "copy arrays are passed to the driver in place");

// The driver functions kvoffload calls; resolved at run time, never linked.
struct DriverApi {
  PFN_cuMemcpyBatchAsync_v13000 batch_v13000 = nullptr;
  PFN_cuMemcpyBatchAsync_v12080 batch_v12080 = nullptr;  // adds failIdx
};

DriverApi ResolveDriverApi() {
  DriverApi api;
  api.batch_v13000 = reinterpret_cast<PFN_cuMemcpyBatchAsync_v13000>(
      ResolveDriverSymbol("cuMemcpyBatchAsync", 13000));
  if (api.batch_v13000 == nullptr) {
    api.batch_v12080 = reinterpret_cast<PFN_cuMemcpyBatchAsync_v12080>(
        ResolveDriverSymbol("cuMemcpyBatchAsync", 12080));
  }
  return api;
}

// A failed resolution throws and is retried on the next call.
const DriverApi& Driver() {
  static const DriverApi api = ResolveDriverApi();
  return api;
}

SrcAccessOrder OrderOf(const CopyBatch& batch, int64_t i) {
  return batch.order == nullptr ? SrcAccessOrder::kStream
                                : static_cast<SrcAccessOrder>(batch.order[i]);
}

// One attribute entry per run of copies with the same source access order.
void AttributeRuns(const CopyBatch& batch, int64_t begin, int64_t end,
                   std::vector<CUmemcpyAttributes>& attrs, std::vector<size_t>& first_copy) {
  attrs.clear();
  first_copy.clear();
  for (int64_t i = begin; i < end; ++i) {
    const auto order = static_cast<CUmemcpySrcAccessOrder>(OrderOf(batch, i));
    if (attrs.empty() || attrs.back().srcAccessOrder != order) {
      CUmemcpyAttributes attr = {};
      attr.srcAccessOrder = order;
      if (batch.prefer_overlap) attr.flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE;
      attrs.push_back(attr);
      first_copy.push_back(static_cast<size_t>(i - begin));
    }
  }
}

CUresult CallBatch(const CopyBatch& batch, int64_t begin, int64_t count,
                   std::vector<CUmemcpyAttributes>& attrs, std::vector<size_t>& first_copy,
                   cudaStream_t stream, size_t* fail_index) {
  auto* dsts = reinterpret_cast<CUdeviceptr*>(const_cast<int64_t*>(batch.dst + begin));
  auto* srcs = reinterpret_cast<CUdeviceptr*>(const_cast<int64_t*>(batch.src + begin));
  auto* sizes = reinterpret_cast<size_t*>(const_cast<int64_t*>(batch.size + begin));
  const DriverApi& api = Driver();
  if (api.batch_v13000 != nullptr) {
    return api.batch_v13000(dsts, srcs, sizes, count, attrs.data(), first_copy.data(),
                            attrs.size(), reinterpret_cast<CUstream>(stream));
  }
  return api.batch_v12080(dsts, srcs, sizes, count, attrs.data(), first_copy.data(),
                          attrs.size(), fail_index, reinterpret_cast<CUstream>(stream));
}

// Copies [begin, count) one cudaMemcpyAsync each; returns the number of calls.
int64_t PerCopy(const CopyBatch& batch, int64_t begin, cudaStream_t stream) {
  bool during_api_call = false;
  for (int64_t i = begin; i < batch.count; ++i) {
    CheckCuda(cudaMemcpyAsync(reinterpret_cast<void*>(batch.dst[i]),
                          reinterpret_cast<const void*>(batch.src[i]), batch.size[i],
                          cudaMemcpyDefault, stream),
          "cudaMemcpyAsync", i);
    during_api_call |= OrderOf(batch, i) == SrcAccessOrder::kDuringApiCall;
  }
  // cudaMemcpyAsync may read later; honour "sources read before return".
  if (during_api_call) CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return batch.count - begin;
}

}  // namespace

int BatchEntryPointVersion() {
  RequireCudaDevice();
  const DriverApi& api = Driver();
  if (api.batch_v13000 != nullptr) return 13000;
  if (api.batch_v12080 != nullptr) return 12080;
  return 0;
}

CopyResult BatchCopy(const CopyBatch& batch, cudaStream_t stream,
                     const BatchCopyOptions& options) {
  ValidateCopyBatch(batch);
  if (options.max_copies_per_call < 0) {
    throw std::invalid_argument("max_copies_per_call: must be >= 0, got " +
                                std::to_string(options.max_copies_per_call));
  }
  CopyResult result;
  if (batch.count == 0) return result;
  result.copies = batch.count;
  result.bytes = TotalBytes(batch);

  RequireCudaDevice();
  StreamDeviceGuard guard(stream);
  result.reason = ChooseDevicePath(reinterpret_cast<uintptr_t>(stream),
                                   BatchEntryPointVersion() != 0, options.per_copy);

  int64_t done = 0;
  if (result.reason == PathReason::kBatchEntryPoint) {
    const int64_t per_call =
        options.max_copies_per_call > 0 ? options.max_copies_per_call : kCopiesPerDriverCall;
    std::vector<CUmemcpyAttributes> attrs;
    std::vector<size_t> first_copy;
    while (done < batch.count) {
      const int64_t count = std::min(per_call, batch.count - done);
      AttributeRuns(batch, done, done + count, attrs, first_copy);
      size_t fail_index = SIZE_MAX;
      const CUresult status =
          CallBatch(batch, done, count, attrs, first_copy, stream, &fail_index);
      if (status == CUDA_ERROR_NOT_SUPPORTED) {
        result.reason = PathReason::kDriverNotSupported;
        break;
      }
      if (status != CUDA_SUCCESS) {
        throw CudaError("cuMemcpyBatchAsync", DriverErrorName(status), status,
                        fail_index == SIZE_MAX ? -1 : done + static_cast<int64_t>(fail_index),
                        done > 0 ? "copies 0-" + std::to_string(done - 1) + " were enqueued" : "");
      }
      ++result.driver_calls;
      done += count;
    }
  }
  if (done < batch.count) result.driver_calls += PerCopy(batch, done, stream);
  return result;
}

int64_t StagingDma(const CopyBatch& batch, Direction direction, cudaStream_t stream) {
  if (direction == Direction::kStore) return BatchCopy(batch, stream).driver_calls;
  std::vector<int64_t> small[3], large[3];
  for (int64_t i = 0; i < batch.count; ++i) {
    std::vector<int64_t>* to = batch.size[i] < kSmallStagingLoad ? small : large;
    to[0].push_back(batch.src[i]);
    to[1].push_back(batch.dst[i]);
    to[2].push_back(batch.size[i]);
  }
  auto of = [](std::vector<int64_t>* v) {
    return CopyBatch{v[0].data(), v[1].data(), v[2].data(), static_cast<int64_t>(v[2].size())};
  };
  BatchCopyOptions one_by_one;
  one_by_one.per_copy = true;
  // Disjoint ranges of the slot: the two parts need no order between them.
  return BatchCopy(of(large), stream).driver_calls +
         BatchCopy(of(small), stream, one_by_one).driver_calls;
}

}  // namespace kvoffload
