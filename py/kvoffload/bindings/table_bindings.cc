// kvoffload._C's lookups in Python's bookkeeping arrays: job-number tables
// (kvoffload.jobs.accesses) and registered regions (kvoffload.copy.registry).

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "cc/keys/key_tables.h"
#include "cc/memory/region_check.h"
#include "py/kvoffload/bindings/bindings.h"

namespace kvoffload {

void BindTables(nb::module_& m) {
  // Job-number tables (kvoffload.jobs.accesses).
  using Table = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
  using Keys = Int64Tensor<1>;
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
}

}  // namespace kvoffload
