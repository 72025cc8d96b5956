#ifndef KVOFFLOAD_PY_KVOFFLOAD_BINDINGS_H_
#define KVOFFLOAD_PY_KVOFFLOAD_BINDINGS_H_

// What every binding file of kvoffload._C reads its arguments with, and the Bind
// function of each topic, which _C.cc calls.

#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>  // every file, or std::string casts differ between them

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace nb = nanobind;

namespace kvoffload {

using ReadOnlyArray = nb::ndarray<nb::ro>;

inline std::string TypeName(nb::handle obj) { return nb::type_name(obj.type()).c_str(); }

inline bool IsCpuDevice(int device_type) {
  return device_type == nb::device::cpu::value || device_type == nb::device::cuda_host::value;
}

// A Python integer (or anything with __index__ but bool) as int64.
inline int64_t ToInt64(nb::handle obj, const std::string& name) {
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
inline bool IsIntScalar(nb::handle obj) {
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

// The package's own int64 arrays, passed from its Python modules: typed and taken only
// with noconvert() arguments, so that nothing is converted on the way. Arrays from
// users go through Int64Array, which names the argument in its errors.
template <size_t N>
using Int64Tensor = nb::ndarray<const int64_t, nb::ndim<N>, nb::c_contig, nb::device::cpu>;

inline std::vector<int64_t> ToVector(const Int64Tensor<1>& array) {
  return std::vector<int64_t>(array.data(), array.data() + array.shape(0));
}

// None (legacy default stream), an int handle, an object with __cuda_stream__
// (the CUDA Python stream protocol) or with a cuda_stream attribute (torch).
inline cudaStream_t ToStream(nb::handle stream) {
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

using Int64Vector = nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>;

// A numpy array that owns `values` (a std::vector<int64_t> or a RecycledBuffer).
template <typename Owned>
Int64Vector ToNumpy(Owned values) {
  auto* owned = new Owned(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<Owned*>(p); });
  return Int64Vector(owned->data(), {owned->size()}, owner);
}

// _C.cc calls them in this order, after binding the errors, the enums and CopyResult.
void BindCopies(nb::module_& m);  // copy_bindings.cc
void BindPages(nb::module_& m);   // page_bindings.cc
void BindTables(nb::module_& m);  // table_bindings.cc
void BindPool(nb::module_& m);    // pool_bindings.cc

}  // namespace kvoffload

#endif  // KVOFFLOAD_PY_KVOFFLOAD_BINDINGS_H_
