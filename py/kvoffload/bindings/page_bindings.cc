// kvoffload._C's page table: jobs named by block and chunk ids, checked once and copied
// between every KV-cache group's tensors and the CPU pool.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cc/copy/copy_path.h"
#include "cc/copy/direction.h"
#include "cc/copy/staging_ring.h"
#include "cc/cuda/stream_device.h"
#include "cc/keys/job_keys.h"
#include "cc/pages/page_copy.h"
#include "cc/pages/page_dma.h"
#include "cc/pages/page_job.h"
#include "cc/pages/page_layout.h"
#include "cc/pages/segments.h"
#include "cc/util/recycled_buffer.h"
#include "py/kvoffload/bindings/bindings.h"

namespace kvoffload {
namespace {

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
  PyPageTable(const Int64Tensor<2>& refs, const Int64Tensor<1>& group_refs,
              const Int64Tensor<1>& gpu_blocks, const Int64Tensor<1>& cpu_chunks,
              int64_t blocks_per_chunk, const Int64Tensor<1>& host_breaks)
      : serial_(NextSerial()),
        layout_(Refs(refs), ToVector(group_refs), ToVector(gpu_blocks), ToVector(cpu_chunks),
                blocks_per_chunk) {
    layout_.set_host_breaks(ToVector(host_breaks));
  }

  // `ids` is a snapshot of the caller's arrays: the check needs no GIL.
  void Check(const JobIds& ids) const {
    nb::gil_scoped_release release;
    ValidateJob(layout_, ids.Job());
  }

  // The keys (JobKeys) of a job this table checked.
  nb::tuple Keys(const PreparedJob& prepared, const Int64Tensor<1>& gpu_offset,
                 const Int64Tensor<1>& cpu_offset) const {
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

  nb::tuple Spans() const {
    const int64_t refs = static_cast<int64_t>(layout_.refs().size());
    std::vector<int64_t> gpu(refs), cpu(refs);
    for (int64_t r = 0; r < refs; ++r) {
      gpu[r] = layout_.gpu_span(r);
      cpu[r] = layout_.cpu_span(r);
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
  nb::tuple PageCopies(const PreparedJob& prepared, Direction direction) const {
    RequireOwn(prepared);
    const PageJob job = prepared.ids.Job();
    PageDma copies;
    {
      nb::gil_scoped_release release;
      std::vector<Segment> segments;
      BuildSegments(layout_, job, segments);
      BuildPageDma(layout_, job.block_ids, segments, direction, copies);
    }
    return nb::make_tuple(ToNumpy(std::move(copies.gpu)), ToNumpy(std::move(copies.host)),
                          ToNumpy(std::move(copies.size)));
  }

  nb::list Rows(int device) {
    nb::list out;
    for (const GroupRows& r : OnDevice(device).rows()) {
      out.append(nb::make_tuple(r.strided, r.why_not, r.rows, r.gpu_pitch, r.host_pitch));
    }
    return out;
  }

  // `checked`: ids that prepare checked (the job's own snapshot).
  CopyResult Copy(const JobIds& ids, Direction direction, nb::handle stream_obj,
                  const PageCopyOptions& options, bool checked = false) {
    const cudaStream_t stream = ToStream(stream_obj);
    const PageJob job = ids.Job();
    nb::gil_scoped_release release;
    // PageCopy validates the job too, but the table is uploaded only for a valid one.
    ValidatePageCopyOptions(options);
    if (!checked) ValidateJob(layout_, job);
    return PageCopy(OnDevice(StreamDevice(stream)), job, direction, stream, options,
                    /*validated=*/true);
  }

 private:
  static std::vector<TensorRef> Refs(const Int64Tensor<2>& array) {
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

  std::vector<int64_t> Offsets(const Int64Tensor<1>& array, const char* name) const {
    std::vector<int64_t> offsets = ToVector(array);
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

void BindPages(nb::module_& m) {
  static const PageCopyOptions kPageDefaults{};
  nb::enum_<PagePath>(m, "PagePath", "How a page job crosses the link (cc/pages/page_copy.h).")
      .value("STAGED", PagePath::kStaged, "DMA through a staging ring, a kernel on the HBM side")
      .value("KERNEL", PagePath::kKernel, "a kernel that reaches the pool itself")
      .value("DMA", PagePath::kDma,
             "cuMemcpyBatchAsync per page, or a 2D copy per block across tensors of one allocation; "
             "no SM work");
  nb::class_<PyPageTable>(m, "PageTable",
                          "Every KV-cache group's tensors and the CPU pool, for jobs named by ids.")
      .def(nb::init<const Int64Tensor<2>&, const Int64Tensor<1>&, const Int64Tensor<1>&,
                    const Int64Tensor<1>&, int64_t, const Int64Tensor<1>&>(),
           nb::arg("refs").noconvert(), nb::arg("group_refs").noconvert(),
           nb::arg("gpu_blocks").noconvert(), nb::arg("cpu_chunks").noconvert(),
           nb::arg("blocks_per_chunk"), nb::arg("host_breaks").noconvert(),
           "Made by kvoffload.pages.table.page_table(layout): int64 arrays only.")
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
          [](const PyPageTable& t, const PreparedJob& job, const Int64Tensor<1>& gpu_offset,
             const Int64Tensor<1>& cpu_offset) { return t.Keys(job, gpu_offset, cpu_offset); },
          nb::arg("job"), nb::arg("gpu_offset").noconvert(), nb::arg("cpu_offset").noconvert(),
          "(gpu_keys, cpu_keys) of a prepared job, as JobKeys numbers them.")
      .def("spans", &PyPageTable::Spans,
           "(gpu_spans, cpu_spans): per tensor, in layout order, the bytes from its base to "
           "the end of its last block (GPU) or chunk (CPU); 0 where the group has none.")
      .def(
          "page_copies",
          [](const PyPageTable& t, const PreparedJob& job, Direction direction) {
            return t.PageCopies(job, direction);
          },
          nb::arg("job"), nb::arg("direction"),
          "(gpu, host, size) of a prepared job moved `direction`: a copy per page, those of one "
          "tensor merged where they continue on both sides and no registration edge lies between, "
          "in the page table's DMA order.")
      .def(
          "unit_copies",
          [](const PyPageTable& t, nb::handle b, nb::handle c, nb::handle g, nb::handle i) {
            return t.UnitCopies(JobIds(b, c, g, i));
          },
          nb::arg("block_ids"), nb::arg("chunk_ids"), nb::arg("group_sizes"),
          nb::arg("block_indices"))
      .def(
          "copy",
          [](PyPageTable& t, nb::handle b, nb::handle c, nb::handle g, nb::handle i, Direction direction,
             nb::handle stream, PagePath path, int max_ctas, int64_t slot_bytes, int slots, int ring,
             SrcAccessOrder src_order, bool slots_in_l2, bool strided, bool row_batches,
             int64_t rows_per_copy, bool prefer_overlap) {
            return t.Copy(JobIds(b, c, g, i), direction, stream,
                          PageCopyOptions{path, max_ctas, slot_bytes, slots, slots_in_l2, ring, src_order,
                                          strided, row_batches, rows_per_copy, prefer_overlap});
          },
          nb::arg("block_ids"), nb::arg("chunk_ids"), nb::arg("group_sizes"),
          nb::arg("block_indices"), nb::arg("direction"), nb::arg("stream").none(),
          nb::arg("path") = kPageDefaults.path, nb::arg("max_ctas") = kPageDefaults.max_ctas,
          nb::arg("slot_bytes") = kPageDefaults.slot_bytes, nb::arg("slots") = kPageDefaults.slots,
          nb::arg("ring") = 0, nb::arg("src_order") = kPageDefaults.src_order,
          nb::arg("slots_in_l2") = kPageDefaults.slots_in_l2, nb::arg("strided") = kPageDefaults.strided,
          nb::arg("row_batches") = kPageDefaults.row_batches,
          nb::arg("rows_per_copy") = kPageDefaults.rows_per_copy,
          nb::arg("prefer_overlap") = kPageDefaults.prefer_overlap)
      .def(
          "copy_job",
          [](PyPageTable& t, const PreparedJob& job, Direction direction, nb::handle stream, PagePath path,
             int max_ctas, int64_t slot_bytes, int slots, int ring, SrcAccessOrder src_order,
             bool slots_in_l2, bool strided, bool row_batches, int64_t rows_per_copy,
             bool prefer_overlap) {
            t.RequireOwn(job);
            return t.Copy(job.ids, direction, stream,
                          PageCopyOptions{path, max_ctas, slot_bytes, slots, slots_in_l2, ring, src_order,
                                          strided, row_batches, rows_per_copy, prefer_overlap},
                          /*checked=*/true);
          },
          nb::arg("job"), nb::arg("direction"), nb::arg("stream").none(), nb::arg("path") = kPageDefaults.path,
          nb::arg("max_ctas") = kPageDefaults.max_ctas, nb::arg("slot_bytes") = kPageDefaults.slot_bytes,
          nb::arg("slots") = kPageDefaults.slots, nb::arg("ring") = 0,
          nb::arg("src_order") = kPageDefaults.src_order, nb::arg("slots_in_l2") = kPageDefaults.slots_in_l2,
          nb::arg("strided") = kPageDefaults.strided, nb::arg("row_batches") = kPageDefaults.row_batches,
          nb::arg("rows_per_copy") = kPageDefaults.rows_per_copy,
          nb::arg("prefer_overlap") = kPageDefaults.prefer_overlap)
      .def(
          "rows",
          [](PyPageTable& t, int device) { return t.Rows(device); }, nb::arg("device"),
          "Per group, (strided, why_not, rows, gpu_pitch, host_pitch): whether the DMA path moves "
          "its blocks as 2D copies, a row per tensor, on `device` (cc/pages/row_copies.h).");
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
  m.attr("PAGE_SLOT_BYTES") = kPageDefaults.slot_bytes;
  m.attr("PAGE_SLOTS") = kPageDefaults.slots;
  m.attr("PAGE_MAX_SLOT_BYTES") = kMaxSlotBytes;
  m.attr("PAGE_MAX_SLOTS") = kMaxSlots;
  m.def("require_fits_l2", &StagingRing::RequireFitsL2, nb::arg("device"), nb::arg("slot_bytes"), nb::arg("slots"),
        "Raises ValueError naming slot_bytes when a ring of slots x slot_bytes does not fit the device's "
        "persisting L2.");
}

}  // namespace kvoffload
