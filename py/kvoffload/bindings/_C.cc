// kvoffload._C: Python bindings of the C++ core. Arguments are checked in the bindings,
// with errors that name them, before anything is copied. Each topic binds in its own
// file (bindings.h lists them); this one binds what they share: the errors, the enums
// and CopyResult.

#include <nanobind/nanobind.h>

#include <string>

#include "cc/copy/copy_batch.h"
#include "cc/copy/copy_path.h"
#include "cc/copy/direction.h"
#include "cc/cuda/cuda_error.h"
#include "cc/memory/memory_map.h"  // through //cc/copy:copy_kernel
#include "py/kvoffload/bindings/bindings.h"

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

  // kvoffload.util.vocabulary.Direction's members are these.
  nb::enum_<Direction>(m, "Direction", "Which way a copy moves bytes.")
      .value("LOAD", Direction::kLoad, "host -> device")
      .value("STORE", Direction::kStore, "device -> host");

  // kvoffload.util.vocabulary.MemoryKind's members are these, but UNKNOWN.
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

  BindCopies(m);
  BindPages(m);
  BindTables(m);
  BindPool(m);
}
