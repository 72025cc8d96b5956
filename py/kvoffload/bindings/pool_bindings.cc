// kvoffload._C's host memory (kvoffload.pool.host_pool): registration, first touch, NUMA
// placement and the pool's registrations.

#include <nanobind/nanobind.h>

#include <cstdint>
#include <vector>

#include "cc/pool/first_touch.h"
#include "cc/pool/host_memory.h"
#include "cc/pool/pinned_pool.h"
#include "py/kvoffload/bindings/bindings.h"

namespace kvoffload {

void BindPool(nb::module_& m) {
  m.def(
      "host_register",
      [](int64_t address, int64_t bytes) {
        nb::gil_scoped_release release;
        HostRegister(address, bytes);
      },
      nb::arg("address"), nb::arg("bytes"));
  m.def("host_unregister", &HostUnregister, nb::arg("address"));
  m.def("is_pinned_host", &IsPinnedHost, nb::arg("address"));
  m.def(
      "pool_touch",
      [](int64_t address, int64_t bytes, const Int64Tensor<1>& cpus, int threads) {
        std::vector<int> cpu_ids(cpus.data(), cpus.data() + cpus.shape(0));
        nb::gil_scoped_release release;
        TouchPages(address, bytes, cpu_ids, threads);
      },
      nb::arg("address"), nb::arg("bytes"), nb::arg("cpus").noconvert(), nb::arg("threads"));
  m.def("pool_prefer_node", &PreferNumaNode, nb::arg("address"), nb::arg("bytes"),
        nb::arg("node"));
  m.def(
      "pool_register",
      [](int64_t address, int64_t bytes, int device) {
        nb::gil_scoped_release release;
        PoolRegister(address, bytes, device);
      },
      nb::arg("address"), nb::arg("bytes"), nb::arg("device"));
  m.def(
      "pool_unregister",
      [](int64_t address, int device) {
        nb::gil_scoped_release release;
        PoolUnregister(address, device);
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

}  // namespace kvoffload
