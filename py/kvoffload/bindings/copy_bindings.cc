// kvoffload._C's copies: of address batches (batch, kernel, staged, host) and of tensor
// blocks, with the array checks and path queries around them.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/copy/batch_copy.h"
#include "cc/copy/block_geometry.h"
#include "cc/copy/block_mapping.h"
#include "cc/copy/copy_batch.h"
#include "cc/copy/copy_kernel.h"
#include "cc/copy/copy_path.h"
#include "cc/copy/direction.h"
#include "cc/copy/host_copy.h"
#include "cc/copy/staged_copy.h"
#include "cc/cuda/capture_mode.h"
#include "cc/cuda/cuda_check.h"
#include "cc/cuda/stream_device.h"
#include "cc/pages/page_copy.h"
#include "cc/util/recycled_buffer.h"
#include "py/kvoffload/bindings/bindings.h"

namespace kvoffload {
namespace {

// One order for every copy (an int or SrcAccessOrder), or one per copy.
std::vector<uint8_t> ToOrders(nb::handle order, int64_t count) {
  if (IsIntScalar(order)) {
    const int64_t value = ToInt64(order, "order");
    if (!IsSrcAccessOrder(value)) {
      throw nb::value_error(("order: " + std::to_string(value) +
                             " is not a source access order (STREAM=1, DURING_API_CALL=2, ANY=3)")
                                .c_str());
    }
    return std::vector<uint8_t>(count, static_cast<uint8_t>(value));
  }
  Int64Array orders(order, "order", 1);
  if (orders.size() != count) {
    throw nb::value_error(("order: has " + std::to_string(orders.size()) +
                           " entries but there are " + std::to_string(count) + " copies")
                              .c_str());
  }
  std::vector<uint8_t> out(count);
  for (int64_t i = 0; i < count; ++i) {
    if (!IsSrcAccessOrder(orders.data()[i])) {
      throw nb::value_error(("order[" + std::to_string(i) + "]: " +
                             std::to_string(orders.data()[i]) + " is not a source access order")
                                .c_str());
    }
    out[i] = static_cast<uint8_t>(orders.data()[i]);
  }
  return out;
}

// src, dst and sizes of equal length.
struct CopyArrays {
  CopyArrays(nb::handle src_obj, nb::handle dst_obj, nb::handle sizes_obj)
      : src(src_obj, "src", 1), dst(dst_obj, "dst", 1), sizes(sizes_obj, "sizes", 1) {
    if (dst.size() != src.size()) {
      throw nb::value_error(("dst: has " + std::to_string(dst.size()) + " entries but src has " +
                             std::to_string(src.size()))
                                .c_str());
    }
    if (sizes.size() != src.size()) {
      throw nb::value_error(("sizes: has " + std::to_string(sizes.size()) +
                             " entries but src has " + std::to_string(src.size()))
                                .c_str());
    }
  }
  CopyBatch Batch(const std::vector<uint8_t>* orders) const {
    return CopyBatch{src.data(), dst.data(), sizes.data(), src.size(),
                     orders == nullptr ? nullptr : orders->data()};
  }
  Int64Array src, dst, sizes;
};

CopyResult RunBatchCopy(const CopyBatch& batch, cudaStream_t stream,
                        const BatchCopyOptions& options) {
  nb::gil_scoped_release release;
  return BatchCopy(batch, stream, options);
}

CopyResult RunHostCopy(const CopyBatch& batch, int threads) {
  nb::gil_scoped_release release;
  return HostCopy(batch, threads);
}

CopyResult PyBatchCopy(nb::handle src, nb::handle dst, nb::handle sizes, nb::handle stream,
                       nb::handle order, int64_t max_copies_per_call, bool per_copy) {
  CopyArrays arrays(src, dst, sizes);
  const std::vector<uint8_t> orders = ToOrders(order, arrays.src.size());
  return RunBatchCopy(arrays.Batch(&orders), ToStream(stream),
                      BatchCopyOptions{max_copies_per_call, per_copy});
}

CopyResult PyKernelCopy(nb::handle src, nb::handle dst, nb::handle sizes, nb::handle stream,
                        int max_ctas, int64_t piece_bytes) {
  CopyArrays arrays(src, dst, sizes);
  const CopyBatch batch = arrays.Batch(nullptr);
  const cudaStream_t s = ToStream(stream);
  nb::gil_scoped_release release;
  return KernelCopy(batch, s, KernelCopyOptions{max_ctas, piece_bytes});
}

CopyResult PyStagedCopy(nb::handle src, nb::handle dst, nb::handle sizes, Direction direction,
                        nb::handle stream, int64_t slot_bytes, int slots, int max_ctas) {
  CopyArrays arrays(src, dst, sizes);
  const CopyBatch batch = arrays.Batch(nullptr);
  const cudaStream_t s = ToStream(stream);
  nb::gil_scoped_release release;
  return StagedCopy(batch, direction, s, StagedCopyOptions{slot_bytes, slots, max_ctas});
}

CopyResult PyHostCopy(nb::handle src, nb::handle dst, nb::handle sizes, int threads) {
  CopyArrays arrays(src, dst, sizes);
  return RunHostCopy(arrays.Batch(nullptr), threads);
}

Int64Vector Snapshot(const Int64Array& array) {
  return ToNumpy(RecycledBuffer(array.data(), array.size()));
}

// The one normaliser of an int64 array argument: a validated copy, read once.
Int64Vector PyInt64Vector(nb::handle values, const std::string& name) {
  return Snapshot(Int64Array(values, name.c_str(), 1));
}

// Validated copies of src, dst and sizes, read once: what is checked against a registry
// is what is copied, whatever the caller's arrays hold by then.
nb::tuple PyCopyArrays(nb::handle src, nb::handle dst, nb::handle sizes) {
  const CopyArrays arrays(src, dst, sizes);
  Int64Vector s = Snapshot(arrays.src), d = Snapshot(arrays.dst), n = Snapshot(arrays.sizes);
  ValidateCopyBatch(CopyBatch{s.data(), d.data(), n.data(), static_cast<int64_t>(n.size())});
  return nb::make_tuple(s, d, n);
}

// A tensor seen as blocks along dim 0, each block's elements contiguous.
struct BlockTensor {
  BlockTensor(nb::handle obj, const char* tensor_name, bool writable) : name(tensor_name) {
    nb::ndarray<> writable_view;
    if ((writable && !nb::try_cast(obj, writable_view, false)) ||
        !nb::try_cast(obj, array, false)) {
      throw nb::type_error((name + ": expected a " + (writable ? "writable " : "") +
                            "DLPack tensor, got " + TypeName(obj))
                               .c_str());
    }
    const int type = array.device_type();
    if (!IsCpuDevice(type) && type != nb::device::cuda::value &&
        type != nb::device::cuda_managed::value) {
      throw nb::value_error((name + ": device type " + std::to_string(type) +
                             " is neither host memory nor CUDA memory")
                                .c_str());
    }
    const int64_t *shape = array.shape_ptr(), *strides = array.stride_ptr();
    at.geometry = BlockGeometryOf(std::vector<int64_t>(shape, shape + array.ndim()),
                                  std::vector<int64_t>(strides, strides + array.ndim()),
                                  static_cast<int64_t>(array.itemsize()), name);
    at.base = reinterpret_cast<int64_t>(array.data());
  }

  bool on_host() const { return array.device_type() == nb::device::cpu::value; }
  bool on_gpu() const { return !IsCpuDevice(array.device_type()); }

  std::string name;
  ReadOnlyArray array;
  BlockTensorAt at;
};

// BlockGeometryOf for Python code (kvoffload.pages.planner) that has no DLPack tensor at hand.
nb::tuple PyBlockGeometry(nb::handle shape, nb::handle strides, int64_t itemsize,
                          const std::string& name) {
  const Int64Array dims(shape, "shape", 1), steps(strides, "strides", 1);
  const BlockGeometry g = BlockGeometryOf(
      std::vector<int64_t>(dims.data(), dims.data() + dims.size()),
      std::vector<int64_t>(steps.data(), steps.data() + steps.size()), itemsize, name);
  return nb::make_tuple(g.blocks, g.block_bytes, g.stride_bytes);
}

void CheckSameBlocks(const BlockTensor& src, const BlockTensor& dst) {
  if (src.array.dtype() != dst.array.dtype()) {
    throw nb::type_error("dst: dtype differs from src's");
  }
  if (src.array.ndim() != dst.array.ndim()) {
    throw nb::value_error("dst: rank differs from src's");
  }
  for (size_t d = 1; d < src.array.ndim(); ++d) {
    if (src.array.shape(d) != dst.array.shape(d)) {
      throw nb::value_error(("dst: shape differs from src's in dim " + std::to_string(d)).c_str());
    }
  }
}

// A GPU tensor must be on the stream's device.
void RequireStreamDevice(const BlockTensor& tensor, cudaStream_t stream) {
  if (!tensor.on_gpu()) return;
  const int device = StreamDevice(stream);
  if (tensor.array.device_id() != device) {
    throw nb::value_error(("stream: is on device " + std::to_string(device) + " but " +
                           tensor.name + " is on device " + std::to_string(tensor.array.device_id()))
                              .c_str());
  }
}

// Copies block mapping[i, 0] of src to block mapping[i, 1] of dst, for every i.
CopyResult PyCopyBlocks(nb::handle src_obj, nb::handle dst_obj, nb::handle mapping_obj,
                        nb::handle stream, nb::handle order, int64_t max_copies_per_call) {
  const BlockTensor src(src_obj, "src", false);
  const BlockTensor dst(dst_obj, "dst", true);
  CheckSameBlocks(src, dst);
  Int64Array mapping(mapping_obj, "block_mapping", 2);
  if (mapping.shape(1) != 2) {
    throw nb::value_error(("block_mapping: expected shape [N, 2], got [" +
                           std::to_string(mapping.shape(0)) + ", " +
                           std::to_string(mapping.shape(1)) + "]")
                              .c_str());
  }
  const BlockCopies copies = MapBlocks(src.at, dst.at, mapping.data(), mapping.shape(0));
  const int64_t count = copies.count();
  const cudaStream_t s = ToStream(stream);
  const std::vector<uint8_t> orders = ToOrders(order, count);
  if (src.on_host() && dst.on_host()) {
    return RunHostCopy(copies.Batch(), 0);
  }
  RequireStreamDevice(src, s);
  RequireStreamDevice(dst, s);
  return RunBatchCopy(copies.Batch(orders.data()), s,
                      BatchCopyOptions{max_copies_per_call, false});
}

}  // namespace

void BindCopies(nb::module_& m) {
  m.attr("COPIES_PER_DRIVER_CALL") = kCopiesPerDriverCall;
  static const KernelCopyOptions kKernelDefaults{};
  static const StagedCopyOptions kStagedDefaults{};
  m.attr("KERNEL_CTAS") = kKernelDefaults.max_ctas;
  m.attr("PIECE_BYTES") = kKernelDefaults.piece_bytes;
  m.attr("STAGED_SLOT_BYTES") = kStagedDefaults.slot_bytes;
  m.attr("STAGED_SLOTS") = kStagedDefaults.slots;
  m.attr("STAGED_CTAS") = kStagedDefaults.max_ctas;
  // Array arguments take None too, so that Int64Array's message names them.
  m.def("batch_copy", &PyBatchCopy, nb::arg("src").none(), nb::arg("dst").none(),
        nb::arg("sizes").none(), nb::arg("stream").none() = nb::none(),
        nb::arg("order").none() = static_cast<int>(SrcAccessOrder::kStream),
        nb::arg("max_copies_per_call") = 0, nb::arg("per_copy") = false);
  m.def("kernel_copy", &PyKernelCopy, nb::arg("src").none(), nb::arg("dst").none(),
        nb::arg("sizes").none(),
        nb::arg("stream").none() = nb::none(), nb::arg("max_ctas") = kKernelDefaults.max_ctas,
        nb::arg("piece_bytes") = kKernelDefaults.piece_bytes);
  m.def("staged_copy", &PyStagedCopy, nb::arg("src").none(), nb::arg("dst").none(),
        nb::arg("sizes").none(),
        nb::arg("direction"), nb::arg("stream").none() = nb::none(),
        nb::arg("slot_bytes") = kStagedDefaults.slot_bytes, nb::arg("slots") = kStagedDefaults.slots,
        nb::arg("max_ctas") = kStagedDefaults.max_ctas);
  m.def("host_copy", &PyHostCopy, nb::arg("src").none(), nb::arg("dst").none(),
        nb::arg("sizes").none(), nb::arg("threads") = 0);
  m.def("copy_arrays", &PyCopyArrays, nb::arg("src").none(), nb::arg("dst").none(),
        nb::arg("sizes").none());
  m.def("int64_vector", &PyInt64Vector, nb::arg("values").none(), nb::arg("name"),
        "values (a 1-D int64 host array or a sequence of ints) validated and copied; "
        "errors name the argument `name`.");
  m.def("block_geometry", &PyBlockGeometry, nb::arg("shape").none(), nb::arg("strides").none(),
        nb::arg("itemsize"), nb::arg("name"),
        "(blocks, block_bytes, stride_bytes) of a tensor of `shape` and `strides` (sequences "
        "of ints, in elements) seen as blocks along dim 0, as copy_blocks sees its tensors; "
        "ValueError naming `name` unless each block is contiguous and no two overlap.");
  m.def("copy_blocks", &PyCopyBlocks, nb::arg("src").none(), nb::arg("dst").none(),
        nb::arg("block_mapping").none(), nb::arg("stream").none() = nb::none(),
        nb::arg("order").none() = static_cast<int>(SrcAccessOrder::kStream),
        nb::arg("max_copies_per_call") = 0);
  m.def(
      "device_path",
      [](nb::handle stream, bool batch_entry_point, bool per_copy) {
        const PathReason reason =
            ChooseDevicePath(reinterpret_cast<uintptr_t>(ToStream(stream)), batch_entry_point,
                             per_copy);
        return nb::make_tuple(PathName(PathFor(reason)), ReasonText(reason));
      },
      nb::arg("stream").none(), nb::arg("batch_entry_point"), nb::arg("per_copy") = false);
  m.def(
      "stream_device", [](nb::handle stream) { return StreamDevice(ToStream(stream)); },
      nb::arg("stream").none());
  m.def(
      "require_not_capturing",
      [](nb::handle stream, const std::string& name) { RequireNotCapturing(ToStream(stream), name.c_str()); },
      nb::arg("stream").none(), nb::arg("name"),
      "ValueError naming `name` where `stream` is capturing a CUDA graph.");
  m.def(
      "in_relaxed_capture_mode",
      [](nb::callable fn) {
        RequireCudaDevice();
        // Restored in C++ however fn ends: an interrupt cannot leave the thread relaxed.
        const RelaxedCaptureMode relaxed;
        return fn();
      },
      nb::arg("fn"),
      "fn() with this thread's stream-capture mode relaxed: its CUDA calls are not refused for "
      "another thread's graph capture in global mode, nor do they invalidate it.");
  m.def("batch_entry_point_version", &BatchEntryPointVersion);
  m.def(
      "load_kernels",
      [](int device) {
        if (device < 0) {
          throw std::invalid_argument("device: must be >= 0, got " + std::to_string(device));
        }
        RequireCudaDevice();
        nb::gil_scoped_release release;
        DeviceGuard guard(device);
        LoadCopyKernel();
        LoadPageCopyKernel();
      },
      nb::arg("device"));
  m.attr("HOST_THREADING_BYTES") = kHostThreadingBytes;
  m.attr("MAX_HOST_THREADS") = kMaxHostThreads;
}

}  // namespace kvoffload
