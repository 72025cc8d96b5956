#include "cc/memory_reach.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>

#include "cc/cuda_error.h"
#include "cc/driver_symbol.h"

namespace kvoffload {
namespace {
constexpr int64_t kHostPage = 4096;
}  // namespace

struct MemoryRange {
  int64_t end = 0;
  unsigned int type = 0;  // CUmemorytype; 0 when the driver does not know the address
  int ordinal = -1;       // the device of device memory
};

// What the driver says of addresses, remembered per range for the length of one batch.
class MemoryMap {
 public:
  const MemoryRange& At(int64_t address) {
    if (last_ != nullptr && last_start_ <= address && address < last_->end) return *last_;
    auto it = known_.upper_bound(address);
    if (it == known_.begin() || address >= std::prev(it)->second.end) it = Query(address);
    else --it;
    last_start_ = it->first;
    last_ = &it->second;
    return *last_;
  }

 private:
  std::map<int64_t, MemoryRange>::iterator Query(int64_t address) {
    static const auto get_attributes = reinterpret_cast<PFN_cuPointerGetAttributes_v7000>(
        ResolveDriverSymbol("cuPointerGetAttributes", 7000));
    if (get_attributes == nullptr) {
      throw CudaError("cuPointerGetAttributes", "CUDA_ERROR_NOT_FOUND", CUDA_ERROR_NOT_FOUND, -1,
                      "the driver lacks cuPointerGetAttributes");
    }
    MemoryRange memory;
    CUdeviceptr start = 0;
    size_t size = 0;
    CUpointer_attribute attributes[] = {
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    void* values[] = {&memory.type, &memory.ordinal, &start, &size};
    // Unknown addresses are not an error here: they come back with type 0.
    const CUresult status =
        get_attributes(4, attributes, values, static_cast<CUdeviceptr>(address));
    if (status != CUDA_SUCCESS) {
      throw CudaError("cuPointerGetAttributes", DriverErrorName(status), status, -1,
                      "could not classify a copy's memory");
    }
    int64_t first = address & ~(kHostPage - 1);
    memory.end = first + kHostPage;
    const int64_t range_start = static_cast<int64_t>(start);
    if (size > 0 && range_start <= address && address < range_start + static_cast<int64_t>(size)) {
      first = range_start;
      memory.end = range_start + static_cast<int64_t>(size);
    }
    return known_.insert_or_assign(first, memory).first;
  }

  std::map<int64_t, MemoryRange> known_;  // by first address
  const MemoryRange* last_ = nullptr;     // the range found last, and its first address
  int64_t last_start_ = 0;
};

namespace {

std::string Hex(int64_t address) {
  char text[24];
  std::snprintf(text, sizeof(text), "%#llx", static_cast<unsigned long long>(address));
  return text;
}

// Why `memory` does not do for `reach` on `device`, or "" when it does.
std::string Unreachable(const MemoryRange& memory, int device, Reach reach) {
  const bool host = memory.type == CU_MEMORYTYPE_HOST;
  const bool on_device = memory.type == CU_MEMORYTYPE_DEVICE || memory.type == CU_MEMORYTYPE_UNIFIED;
  if (!host && !on_device) {
    return "is neither page-locked host memory nor device memory (pageable host memory?); "
           "kernels reach host memory through the GPU's mapping, so page-lock it "
           "(kvoffload.host_register or a pinned allocation) or use the batch copy";
  }
  if (host && reach == Reach::kDevice) return "is host memory where device memory is needed";
  if (on_device && reach == Reach::kPinnedHost) {
    return "is device memory where page-locked host memory is needed";
  }
  if (on_device && memory.ordinal != device) {
    return "is memory of device " + std::to_string(memory.ordinal) + ", but the stream is on device " +
           std::to_string(device);
  }
  return "";
}

}  // namespace

AddressRanges::AddressRanges() : map_(std::make_unique<MemoryMap>()) {}
AddressRanges::~AddressRanges() = default;
int64_t AddressRanges::End(int64_t address) { return map_->At(address).end; }

void RequireReachable(const int64_t* addresses, const int64_t* sizes, int64_t count, int device,
                      Reach reach, const char* side) {
  MemoryMap map;
  for (int64_t i = 0; i < count; ++i) {
    for (const int64_t address : {addresses[i], addresses[i] + sizes[i] - 1}) {
      const std::string why = Unreachable(map.At(address), device, reach);
      if (!why.empty()) {
        throw std::invalid_argument(std::string(side) + "[" + std::to_string(i) + "]: " +
                                    Hex(address) + " " + why);
      }
    }
  }
}

}  // namespace kvoffload
