#include "cc/memory/reach_check.h"

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace kvoffload {
namespace {

std::string Hex(int64_t address) {
  char text[24];
  std::snprintf(text, sizeof(text), "%#llx", static_cast<unsigned long long>(address));
  return text;
}

// Why `memory` does not do for `reach` on `device`, or "" when it does.
std::string Unreachable(const Memory& memory, int device, Reach reach) {
  const bool host = memory.kind == MemoryKind::kHost;
  const bool on_device = memory.kind == MemoryKind::kDevice;
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

void RequireReachableIn(MemoryMap& map, const int64_t* addresses, const int64_t* sizes,
                        int64_t count, int device, Reach reach, const char* side) {
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
