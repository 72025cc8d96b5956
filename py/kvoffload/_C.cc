// kvoffload._C: Python bindings of the C++ core. Arguments are checked here, with
// errors that name them, before anything is copied.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cc/batch_copy.h"
#include "cc/block_geometry.h"
#include "cc/block_mapping.h"
#include "cc/copy_batch.h"
#include "cc/copy_kernel.h"
#include "cc/copy_path.h"
#include "cc/cuda_check.h"
#include "cc/cuda_error.h"
#include "cc/first_touch.h"
#include "cc/host_copy.h"
#include "cc/host_memory.h"
#include "cc/key_tables.h"
#include "cc/memory_map.h"  // through //cc:copy_kernel
#include "cc/page_copy.h"
#include "cc/page_table.h"
#include "cc/pinned_pool.h"
#include "cc/recycled_buffer.h"
#include "cc/region_check.h"
#include "cc/staged_copy.h"
#include "cc/stream_device.h"

namespace nb = nanobind;

namespace kvoffload {
namespace {

using ReadOnlyArray = nb::ndarray<nb::ro>;

std::string TypeName(nb::handle obj) { return nb::type_name(obj.type()).c_str(); }

bool IsCpuDevice(int device_type) {
  return device_type == nb::device::cpu::value || device_type == nb::device::cuda_host::value;
}

// A Python integer (or anything with __index__ but bool) as int64.
int64_t ToInt64(nb::handle obj, const std::string& name) {
  if (PyBool_Check(obj.ptr()) || PyFloat_Check(obj.ptr())) {
    throw nb::type_error((name + ": expected an int, got " + TypeName(obj)).c_str());
  }
  nb::object index = nb::steal(PyNumber_Index(obj.ptr()));
  if (!index.is_valid()) {
    PyErr_Clear();
    throw nb::type_error((name + ": expected an int, got " + TypeName(obj)).c_str());
  }
  const long long value = PyLong_AsLongLong(index.ptr());
  if (value == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw nb::value_error((name + ": does not fit in int64").c_str());
  }
  return value;
}

// An int or an integer scalar (np.int64), not a bool or an array.
bool IsIntScalar(nb::handle obj) {
  return PyIndex_Check(obj.ptr()) && !PyBool_Check(obj.ptr()) && !PySequence_Check(obj.ptr());
}

// An int64 array argument: a view of a C-contiguous CPU DLPack array of rank `ndim`
// (numpy, torch), or for rank 1 also a sequence of ints, converted.
class Int64Array {
 public:
  Int64Array(nb::handle obj, const char* name, size_t ndim) : name_(name) {
    if (nb::ndarray_check(obj)) {
      FromArray(obj, ndim);
    } else if (ndim == 1 && PySequence_Check(obj.ptr()) && !PyUnicode_Check(obj.ptr()) &&
               !PyBytes_Check(obj.ptr())) {
      FromSequence(obj);
    } else {
      throw nb::type_error((name_ + ": expected a " + std::to_string(ndim) +
                            "-D int64 array" + (ndim == 1 ? " or a sequence of ints" : "") +
                            ", got " + TypeName(obj))
                               .c_str());
    }
  }

  const int64_t* data() const { return data_; }
  int64_t size() const { return size_; }
  int64_t shape(size_t i) const { return static_cast<int64_t>(array_.shape(i)); }

 private:
  void FromArray(nb::handle obj, size_t ndim) {
    if (!nb::try_cast(obj, array_, false)) {
      throw nb::type_error((name_ + ": not a DLPack array this module can read, got " +
                            TypeName(obj))
                               .c_str());
    }
    if (array_.ndim() != ndim) {
      throw nb::value_error((name_ + ": expected a " + std::to_string(ndim) +
                             "-D array, got " + std::to_string(array_.ndim()) + "-D")
                                .c_str());
    }
    if (array_.dtype() != nb::dtype<int64_t>()) {
      throw nb::type_error((name_ + ": expected dtype int64").c_str());
    }
    if (!IsCpuDevice(array_.device_type())) {
      throw nb::value_error((name_ + ": must be in host memory, got device type " +
                             std::to_string(array_.device_type()))
                                .c_str());
    }
    int64_t expected = 1;
    for (size_t d = ndim; d-- > 0 && array_.size() > 0;) {
      if (array_.shape(d) != 1 && array_.stride(d) != expected) {
        throw nb::value_error((name_ + ": must be C-contiguous").c_str());
      }
      expected *= static_cast<int64_t>(array_.shape(d));
    }
    size_ = static_cast<int64_t>(array_.size());
    data_ = static_cast<const int64_t*>(array_.data());
  }

  void FromSequence(nb::handle obj) {
    const Py_ssize_t n = PySequence_Size(obj.ptr());
    if (n < 0) {
      PyErr_Clear();
      throw nb::type_error((name_ + ": sequence has no length").c_str());
    }
    owned_.resize(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      nb::object item = nb::steal(PySequence_GetItem(obj.ptr(), i));
      if (!item.is_valid()) throw nb::python_error();
      owned_[i] = ToInt64(item, name_ + "[" + std::to_string(i) + "]");
    }
    data_ = owned_.data();
    size_ = n;
  }

  std::string name_;
  ReadOnlyArray array_;
  std::vector<int64_t> owned_;
  const int64_t* data_ = nullptr;
  int64_t size_ = 0;
};

// None (legacy default stream), an int handle, an object with __cuda_stream__
// (the CUDA Python stream protocol) or with a cuda_stream attribute (torch).
cudaStream_t ToStream(nb::handle stream) {
  if (stream.is_none()) return nullptr;
  nb::object handle = nb::borrow(stream);
  if (nb::hasattr(stream, "__cuda_stream__")) {
    nb::object pair = stream.attr("__cuda_stream__")();
    if (!nb::isinstance<nb::tuple>(pair) || nb::len(pair) != 2) {
      throw nb::type_error("stream: __cuda_stream__() must return (version, handle)");
    }
    handle = pair[1];
  } else if (nb::hasattr(stream, "cuda_stream")) {
    handle = stream.attr("cuda_stream");
  } else if (!IsIntScalar(stream)) {
    throw nb::type_error(("stream: expected None, an int handle, or a stream object with "
                          "__cuda_stream__ or cuda_stream, got " +
                          TypeName(stream))
                             .c_str());
  }
  const int64_t value = ToInt64(handle, "stream");
  if (value < 0) throw nb::value_error("stream: handle must be >= 0");
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(value));
}

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

CopyResult PyStagedCopy(nb::handle src, nb::handle dst, nb::handle sizes, bool host_is_src,
                        nb::handle stream, int64_t slot_bytes, int slots, int max_ctas) {
  CopyArrays arrays(src, dst, sizes);
  const CopyBatch batch = arrays.Batch(nullptr);
  const cudaStream_t s = ToStream(stream);
  nb::gil_scoped_release release;
  return StagedCopy(batch, host_is_src, s, StagedCopyOptions{slot_bytes, slots, max_ctas});
}

CopyResult PyHostCopy(nb::handle src, nb::handle dst, nb::handle sizes, int threads) {
  CopyArrays arrays(src, dst, sizes);
  return RunHostCopy(arrays.Batch(nullptr), threads);
}

using Int64Vector = nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>;

// A numpy array that owns `values` (a std::vector<int64_t> or a RecycledBuffer).
template <typename Owned>
Int64Vector ToNumpy(Owned values) {
  auto* owned = new Owned(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<Owned*>(p); });
  return Int64Vector(owned->data(), {owned->size()}, owner);
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

// BlockGeometryOf for Python code (kvoffload.planner) that has no DLPack tensor at hand.
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


// A job's ids, copied once: checked and enqueued from the same snapshot, whatever
// another thread does to the caller's arrays meanwhile.
// `names`: None, or the caller's names of (block_ids, chunk_ids, group_sizes,
// block_indices), which every message about them uses.
JobNames ToJobNames(nb::handle names) {
  JobNames out;
  if (names.is_none()) return out;
  if (!nb::isinstance<nb::tuple>(names) || nb::len(names) != 4) {
    throw nb::type_error("names: expected None or a tuple of 4 str");
  }
  std::string* fields[] = {&out.block_ids, &out.chunk_ids, &out.group_sizes, &out.block_indices};
  for (size_t i = 0; i < 4; ++i) {
    nb::handle name = names[i];
    if (!nb::isinstance<nb::str>(name)) throw nb::type_error("names: expected None or a tuple of 4 str");
    *fields[i] = nb::cast<std::string>(name);
  }
  return out;
}

struct JobIds {
  JobIds(nb::handle block_ids, nb::handle chunk_ids, nb::handle group_sizes,
         nb::handle block_indices, nb::handle field_names = nb::none())
      : names(ToJobNames(field_names)),
        blocks(Copy(block_ids, names.block_ids)),
        chunks(Copy(chunk_ids, names.chunk_ids)) {
    Take(group_sizes, names.group_sizes, sizes);
    Take(block_indices, names.block_indices, firsts);
    if (firsts.size() != sizes.size()) {
      throw nb::value_error((names.block_indices + ": has " + std::to_string(firsts.size()) +
                             " entries but " + names.group_sizes + " has " +
                             std::to_string(sizes.size()))
                                .c_str());
    }
  }
  static RecycledBuffer Copy(nb::handle obj, const std::string& name) {
    const Int64Array array(obj, name.c_str(), 1);
    return RecycledBuffer(array.data(), array.size());
  }
  static void Take(nb::handle obj, const std::string& name, std::vector<int64_t>& out) {
    const Int64Array array(obj, name.c_str(), 1);
    out.assign(array.data(), array.data() + array.size());
  }
  PageJob Job() const {
    return PageJob{blocks.data(), static_cast<int64_t>(blocks.size()),
                   chunks.data(), static_cast<int64_t>(chunks.size()),
                   sizes.data(),  firsts.data(),
                   static_cast<int64_t>(sizes.size()), &names};
  }
  JobNames names;
  RecycledBuffer blocks, chunks;
  std::vector<int64_t> sizes, firsts;
};

// A job's ids as PageTable.prepare copied and checked them: its keys and its copy read
// this one snapshot, whatever the caller does to its arrays afterwards. Immutable.
struct PreparedJob {
  PreparedJob(JobIds checked, uint64_t checked_by) : ids(std::move(checked)), table(checked_by) {}
  const JobIds ids;
  const uint64_t table;  // the serial number of the PageTable whose layout checked the ids
};

// A PageLayout, uploaded to each device on its first copy there.
class PyPageTable {
 public:
  PyPageTable(nb::handle refs, nb::handle group_refs, nb::handle gpu_blocks,
              nb::handle cpu_chunks, int64_t blocks_per_chunk, nb::handle host_breaks)
      : serial_(NextSerial()),
        layout_(Refs(refs), Vector(group_refs, "group_refs"), Vector(gpu_blocks, "gpu_blocks"),
                Vector(cpu_chunks, "cpu_chunks"), blocks_per_chunk) {
    layout_.set_host_breaks(Vector(host_breaks, "host_breaks"));
  }

  // `ids` is a snapshot of the caller's arrays: the check needs no GIL.
  void Check(const JobIds& ids) const {
    nb::gil_scoped_release release;
    ValidateJob(layout_, ids.Job());
  }

  // The keys (JobKeys) of a job this table checked.
  nb::tuple Keys(const PreparedJob& prepared, nb::handle gpu_offset, nb::handle cpu_offset) const {
    RequireOwn(prepared);
    const std::vector<int64_t> gpu_offsets = Offsets(gpu_offset, "gpu_offset");
    const std::vector<int64_t> cpu_offsets = Offsets(cpu_offset, "cpu_offset");
    const PageJob job = prepared.ids.Job();
    RecycledBuffer gpu(job.num_block_ids), cpu(job.num_block_ids);
    {
      nb::gil_scoped_release release;
      JobKeys(layout_, job, gpu_offsets.data(), cpu_offsets.data(), gpu.data(), cpu.data());
    }
    return nb::make_tuple(ToNumpy(std::move(gpu)), ToNumpy(std::move(cpu)));
  }

  void RequireOwn(const PreparedJob& job) const {
    if (job.table != serial_) throw nb::value_error("job: was prepared by another PageTable");
  }

  nb::tuple UnitCopies(const JobIds& ids) const {
    const PageJob job = ids.Job();
    ValidateJob(layout_, job);
    std::vector<Segment> segments;
    const int64_t units = BuildSegments(layout_, job, segments);
    std::vector<int64_t> gpu, host, size;
    kvoffload::UnitCopies(layout_, job.block_ids, segments, units, gpu, host, size);
    return nb::make_tuple(ToNumpy(std::move(gpu)), ToNumpy(std::move(host)),
                          ToNumpy(std::move(size)));
  }

  // One copy per page, pages of one tensor merged where they continue on both sides
  // (BuildPageDma): the copies of every method that plans on the host.
  nb::tuple PageCopies(const PreparedJob& prepared) const {
    RequireOwn(prepared);
    const PageJob job = prepared.ids.Job();
    PageDma copies;
    {
      nb::gil_scoped_release release;
      std::vector<Segment> segments;
      BuildSegments(layout_, job, segments);
      BuildPageDma(layout_, job.block_ids, segments, copies);
    }
    return nb::make_tuple(ToNumpy(std::move(copies.gpu)), ToNumpy(std::move(copies.host)),
                          ToNumpy(std::move(copies.size)));
  }

  // `checked`: ids that prepare checked (the job's own snapshot).
  CopyResult Copy(const JobIds& ids, bool load, nb::handle stream_obj,
                  const PageCopyOptions& options, bool checked = false) {
    const cudaStream_t stream = ToStream(stream_obj);
    const PageJob job = ids.Job();
    nb::gil_scoped_release release;
    // PageCopy validates the job too, but the table is uploaded only for a valid one.
    ValidatePageCopyOptions(options);
    if (!checked) ValidateJob(layout_, job);
    return PageCopy(OnDevice(StreamDevice(stream)), job, load, stream, options,
                    /*validated=*/true);
  }

 private:
  static std::vector<TensorRef> Refs(nb::handle obj) {
    const Int64Array array(obj, "refs", 2);
    if (array.size() > 0 && array.shape(1) != 5) {
      throw nb::value_error("refs: expected shape [N, 5] (gpu_base, gpu_stride, page_bytes, "
                            "cpu_base, cpu_stride)");
    }
    std::vector<TensorRef> refs(array.size() / 5);
    for (size_t r = 0; r < refs.size(); ++r) {
      const int64_t* row = array.data() + 5 * r;
      refs[r] = TensorRef{row[0], row[1], row[2], row[3], row[4]};
    }
    return refs;
  }

  std::vector<int64_t> Offsets(nb::handle obj, const char* name) const {
    std::vector<int64_t> offsets = Vector(obj, name);
    if (static_cast<int64_t>(offsets.size()) != layout_.groups()) {
      throw nb::value_error((std::string(name) + ": needs one entry per group (" +
                             std::to_string(layout_.groups()) + ")")
                                .c_str());
    }
    for (int64_t o : offsets) {
      if (o < 0 || o >= (int64_t{1} << 62)) {
        throw nb::value_error((std::string(name) + ": entries must be in [0, 2^62)").c_str());
      }
    }
    return offsets;
  }

  static std::vector<int64_t> Vector(nb::handle obj, const char* name) {
    std::vector<int64_t> out;
    JobIds::Take(obj, name, out);
    return out;
  }

  const DevicePageTable& OnDevice(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::unique_ptr<DevicePageTable>& table = tables_[device];
    if (table == nullptr) table = std::make_unique<DevicePageTable>(layout_, device);
    return *table;
  }

  static uint64_t NextSerial() {
    static std::atomic<uint64_t> next{1};
    return next++;
  }

 public:
  // Unique per table, never reused (an address could be, once a table is freed).
  const uint64_t serial_;

 private:
  PageLayout layout_;
  std::mutex mutex_;
  std::map<int, std::unique_ptr<DevicePageTable>> tables_;
};

}  // namespace
}  // namespace kvoffload

NB_MODULE(_C, m) {
  using namespace kvoffload;
  m.doc() = "kvoffload's C++ core: batch copies between GPU and host memory.";

  nb::exception<CudaError> cuda_error(m, "CudaError", PyExc_RuntimeError);
  nb::exception<NoCudaDeviceError>(m, "NoCudaDeviceError", cuda_error);

  nb::enum_<SrcAccessOrder>(m, "SrcAccessOrder", nb::is_arithmetic(),
                            "When a copy may read its source.")
      .value("STREAM", SrcAccessOrder::kStream, "in stream order")
      .value("DURING_API_CALL", SrcAccessOrder::kDuringApiCall,
             "before the submitting call returns")
      .value("ANY", SrcAccessOrder::kAny, "at any time; the source must be quiescent");

  // kvoffload.vocabulary.MemoryKind's members are these, but UNKNOWN.
  nb::enum_<MemoryKind>(m, "MemoryKind", "What memory an address is, as the driver says.")
      .value("UNKNOWN", MemoryKind::kUnknown, "unknown to the driver: pageable host memory")
      .value("HOST", MemoryKind::kHost, "page-locked host memory")
      .value("DEVICE", MemoryKind::kDevice, "device or managed memory");

  nb::class_<CopyResult>(m, "CopyResult", "What a copy call did.")
      .def_prop_ro("path", [](const CopyResult& r) { return PathName(PathFor(r.reason)); })
      .def_prop_ro("reason", [](const CopyResult& r) { return ReasonText(r.reason); })
      .def_ro("copies", &CopyResult::copies)
      .def_ro("bytes", &CopyResult::bytes)
      .def_ro("driver_calls", &CopyResult::driver_calls)
      .def("__repr__", [](const CopyResult& r) {
        return std::string("CopyResult(path='") + PathName(PathFor(r.reason)) + "', reason='" +
               ReasonText(r.reason) + "', copies=" + std::to_string(r.copies) +
               ", bytes=" + std::to_string(r.bytes) +
               ", driver_calls=" + std::to_string(r.driver_calls) + ")";
      });

  m.attr("COPIES_PER_DRIVER_CALL") = kCopiesPerDriverCall;
  // Array arguments take None too, so that Int64Array's message names them.
  m.def("batch_copy", &PyBatchCopy, nb::arg("src").none(), nb::arg("dst").none(),
        nb::arg("sizes").none(), nb::arg("stream").none() = nb::none(),
        nb::arg("order").none() = static_cast<int>(SrcAccessOrder::kStream),
        nb::arg("max_copies_per_call") = 0, nb::arg("per_copy") = false);
  m.def("kernel_copy", &PyKernelCopy, nb::arg("src").none(), nb::arg("dst").none(),
        nb::arg("sizes").none(),
        nb::arg("stream").none() = nb::none(), nb::arg("max_ctas") = 8,
        nb::arg("piece_bytes") = int64_t{64} << 10);
  m.def("staged_copy", &PyStagedCopy, nb::arg("src").none(), nb::arg("dst").none(),
        nb::arg("sizes").none(),
        nb::arg("host_is_src"), nb::arg("stream").none() = nb::none(),
        nb::arg("slot_bytes") = int64_t{16} << 20, nb::arg("slots") = 4, nb::arg("max_ctas") = 8);
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
  m.def(
      "host_register",
      [](int64_t address, int64_t bytes) {
        nb::gil_scoped_release release;
        HostRegister(address, bytes);
      },
      nb::arg("address"), nb::arg("bytes"));
  m.def("host_unregister", &HostUnregister, nb::arg("address"));
  m.def("is_pinned_host", &IsPinnedHost, nb::arg("address"));
  m.attr("HOST_THREADING_BYTES") = kHostThreadingBytes;
  m.attr("MAX_HOST_THREADS") = kMaxHostThreads;
  static const PageCopyOptions kPageDefaults{};
  nb::enum_<PagePath>(m, "PagePath", "How a page job crosses the link (cc/page_copy.h).")
      .value("STAGED", PagePath::kStaged, "DMA through a staging ring, a kernel on the HBM side")
      .value("KERNEL", PagePath::kKernel, "a kernel that reaches the pool itself")
      .value("DMA", PagePath::kDma, "cuMemcpyBatchAsync per page, no SM work");
  nb::class_<PyPageTable>(m, "PageTable",
                          "Every KV-cache group's tensors and the CPU pool, for jobs named by ids.")
      .def(nb::init<nb::handle, nb::handle, nb::handle, nb::handle, int64_t, nb::handle>(),
           nb::arg("refs"), nb::arg("group_refs"), nb::arg("gpu_blocks"), nb::arg("cpu_chunks"),
           nb::arg("blocks_per_chunk"), nb::arg("host_breaks") = nb::tuple())
      .def(
          "check",
          [](const PyPageTable& t, nb::handle b, nb::handle c, nb::handle g, nb::handle i,
             nb::handle names) { t.Check(JobIds(b, c, g, i, names)); },
          nb::arg("block_ids"), nb::arg("chunk_ids"), nb::arg("group_sizes"),
          nb::arg("block_indices"), nb::arg("names").none() = nb::none())
      .def(
          "prepare",
          [](const PyPageTable& t, nb::handle b, nb::handle c, nb::handle g, nb::handle i,
             nb::handle names) {
            auto job = std::make_unique<PreparedJob>(JobIds(b, c, g, i, names), t.serial_);
            t.Check(job->ids);
            return job.release();
          },
          nb::arg("block_ids"), nb::arg("chunk_ids"), nb::arg("group_sizes"),
          nb::arg("block_indices"), nb::arg("names").none() = nb::none(), nb::rv_policy::take_ownership,
          "Copies the ids once and checks them: a job that keys(job) numbers and "
          "copy_job(job) moves, exactly as checked. names: what errors call the four "
          "arrays (None: their parameter names).")
      .def(
          "keys",
          [](const PyPageTable& t, const PreparedJob& job, nb::handle gpu_offset,
             nb::handle cpu_offset) { return t.Keys(job, gpu_offset, cpu_offset); },
          nb::arg("job"), nb::arg("gpu_offset"), nb::arg("cpu_offset"),
          "(gpu_keys, cpu_keys) of a prepared job, as JobKeys numbers them.")
      .def(
          "page_copies", [](const PyPageTable& t, const PreparedJob& job) { return t.PageCopies(job); },
          nb::arg("job"),
          "(gpu, host, size) of a prepared job: a copy per page, those of one tensor merged where "
          "they continue on both sides and no registration edge lies between.")
      .def(
          "unit_copies",
          [](const PyPageTable& t, nb::handle b, nb::handle c, nb::handle g, nb::handle i) {
            return t.UnitCopies(JobIds(b, c, g, i));
          },
          nb::arg("block_ids"), nb::arg("chunk_ids"), nb::arg("group_sizes"),
          nb::arg("block_indices"))
      .def(
          "copy",
          [](PyPageTable& t, nb::handle b, nb::handle c, nb::handle g, nb::handle i, bool load,
             nb::handle stream, PagePath path, int max_ctas, int64_t slot_bytes, int slots, int ring) {
            return t.Copy(JobIds(b, c, g, i), load, stream,
                          PageCopyOptions{path, max_ctas, slot_bytes, slots, ring});
          },
          nb::arg("block_ids"), nb::arg("chunk_ids"), nb::arg("group_sizes"),
          nb::arg("block_indices"), nb::arg("load"), nb::arg("stream").none(),
          nb::arg("path") = kPageDefaults.path, nb::arg("max_ctas") = kPageDefaults.max_ctas,
          nb::arg("slot_bytes") = kPageDefaults.slot_bytes, nb::arg("slots") = kPageDefaults.slots,
          nb::arg("ring") = 0)
      .def(
          "copy_job",
          [](PyPageTable& t, const PreparedJob& job, bool load, nb::handle stream, PagePath path,
             int max_ctas, int64_t slot_bytes, int slots, int ring) {
            t.RequireOwn(job);
            return t.Copy(job.ids, load, stream, PageCopyOptions{path, max_ctas, slot_bytes, slots, ring},
                          /*checked=*/true);
          },
          nb::arg("job"), nb::arg("load"), nb::arg("stream").none(), nb::arg("path") = kPageDefaults.path,
          nb::arg("max_ctas") = kPageDefaults.max_ctas, nb::arg("slot_bytes") = kPageDefaults.slot_bytes,
          nb::arg("slots") = kPageDefaults.slots, nb::arg("ring") = 0);
  nb::class_<PreparedJob>(m, "PreparedJob", "A job's ids, copied and checked by PageTable.prepare.")
      .def(
          "ids",
          [](const PreparedJob& j) {
            const JobIds& ids = j.ids;
            return nb::make_tuple(ToNumpy(RecycledBuffer(ids.blocks.data(), ids.blocks.size())),
                                  ToNumpy(RecycledBuffer(ids.chunks.data(), ids.chunks.size())),
                                  ToNumpy(j.ids.sizes), ToNumpy(j.ids.firsts));
          },
          "Copies of (block_ids, chunk_ids, group_sizes, block_indices).");
  m.attr("PAGE_UNIT_BYTES") = kPageUnitBytes;
  m.attr("PAGE_COPY_CTAS") = kPageDefaults.max_ctas;

  // Job-number tables (kvoffload.lane_accesses).
  using Table = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
  using Keys = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
  auto keyed = [](Table& table, const Keys& keys, const char* name) {
    return KeyedTable{table.data(), static_cast<int64_t>(table.shape(0)), keys.data(),
                      static_cast<int64_t>(keys.shape(0)), name};
  };
  m.def(
      "tables_fill",
      [keyed](Table a, Keys a_keys, Table b, Keys b_keys, int64_t value) {
        nb::gil_scoped_release release;
        FillTables(keyed(a, a_keys, "a_keys"), keyed(b, b_keys, "b_keys"), value);
      },
      nb::arg("a").noconvert(), nb::arg("a_keys").noconvert(), nb::arg("b").noconvert(),
      nb::arg("b_keys").noconvert(), nb::arg("value"),
      "a[a_keys] = value; b[b_keys] = value: both or, on bad keys, neither.");
  m.def(
      "table_since",
      [keyed](Table table, Keys keys, int64_t since) {
        std::vector<int64_t> found;
        {
          nb::gil_scoped_release release;
          found = ValuesSince(keyed(table, keys, "keys"), since);
        }
        return ToNumpy(std::move(found));
      },
      nb::arg("table").noconvert(), nb::arg("keys").noconvert(), nb::arg("since"),
      "The distinct values >= since of table[keys], ascending.");

  m.def(
      "first_copy_outside",
      [](Keys starts, Keys ends, Keys addresses, Keys sizes) {
        if (starts.shape(0) != ends.shape(0) || addresses.shape(0) != sizes.shape(0)) {
          throw nb::value_error("first_copy_outside: starts and ends, addresses and sizes "
                                "must have equal lengths");
        }
        const int64_t i = FirstCopyOutside(starts.data(), ends.data(),
                                           static_cast<int64_t>(starts.shape(0)), addresses.data(),
                                           sizes.data(), static_cast<int64_t>(addresses.shape(0)));
        if (i < 0) return nb::make_tuple(i, 0, 0);
        return nb::make_tuple(i, addresses.data()[i], sizes.data()[i]);
      },
      nb::arg("starts").noconvert(), nb::arg("ends").noconvert(),
      nb::arg("addresses").noconvert(), nb::arg("sizes").noconvert(),
      "(i, address, size) of the first copy that is empty or not inside one of the sorted, "
      "disjoint intervals [starts[j], ends[j]), as read when checked; (-1, 0, 0) if none is.");

  // The host pool (kvoffload.host_pool): first touch, NUMA placement, registration.
  m.def(
      "pool_touch",
      [](int64_t address, int64_t bytes, nb::handle cpus, int threads) {
        const Int64Array cpu_list(cpus, "cpus", 1);
        std::vector<int> cpu_ids(cpu_list.data(), cpu_list.data() + cpu_list.size());
        nb::gil_scoped_release release;
        TouchPages(address, bytes, cpu_ids, threads);
      },
      nb::arg("address"), nb::arg("bytes"), nb::arg("cpus"), nb::arg("threads"));
  m.def("pool_prefer_node", &PreferNumaNode, nb::arg("address"), nb::arg("bytes"),
        nb::arg("node"));
  m.def(
      "pool_register",
      [](int64_t address, int64_t bytes, int device) {
        nb::gil_scoped_release release;
        RegisterPoolPiece(address, bytes, device);
      },
      nb::arg("address"), nb::arg("bytes"), nb::arg("device"));
  m.def(
      "pool_unregister",
      [](int64_t address, int device) {
        nb::gil_scoped_release release;
        UnregisterPoolPiece(address, device);
      },
      nb::arg("address"), nb::arg("device"));
  m.def("pool_register_supported", &HostRegisterSupported, nb::arg("device"));
  m.def("pool_numa_node", &HostNumaNode, nb::arg("device"));
  m.def(
      "pool_host_alloc",
      [](int64_t bytes, int device) {
        nb::gil_scoped_release release;
        return PoolHostAlloc(bytes, device);
      },
      nb::arg("bytes"), nb::arg("device"));
  m.def(
      "pool_free_host",
      [](int64_t address, int device) {
        nb::gil_scoped_release release;
        PoolFreeHost(address, device);
      },
      nb::arg("address"), nb::arg("device"));
}
