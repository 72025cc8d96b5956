#include "cc/memory/memory_reach.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include "cc/cuda/cuda_error.h"
#include "cc/cuda/driver_symbol.h"
#include "cc/memory/memory_map.h"

namespace kvoffload {

PointerAttributes AskDriver(int64_t address) {
  static const auto get_attributes = reinterpret_cast<PFN_cuPointerGetAttributes_v7000>(
      ResolveDriverSymbol("cuPointerGetAttributes", 7000));
  if (get_attributes == nullptr) {
    throw CudaError("cuPointerGetAttributes", "CUDA_ERROR_NOT_FOUND", CUDA_ERROR_NOT_FOUND, -1,
                    "the driver lacks cuPointerGetAttributes");
  }
  unsigned int type = 0;  // CUmemorytype; 0 when the driver does not know the address
  int ordinal = -1;
  CUdeviceptr start = 0;
  size_t size = 0;
  CUpointer_attribute attributes[] = {
      CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
      CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void* values[] = {&type, &ordinal, &start, &size};
  const CUresult status = get_attributes(4, attributes, values, static_cast<CUdeviceptr>(address));
  if (status != CUDA_SUCCESS) {
    throw CudaError("cuPointerGetAttributes", DriverErrorName(status), status, -1,
                    "could not classify a copy's memory");
  }
  PointerAttributes answer;
  answer.kind = type == CU_MEMORYTYPE_HOST ? MemoryKind::kHost
                : type == CU_MEMORYTYPE_DEVICE || type == CU_MEMORYTYPE_UNIFIED
                    ? MemoryKind::kDevice
                    : MemoryKind::kUnknown;
  answer.ordinal = ordinal;
  answer.range_start = static_cast<int64_t>(start);
  answer.range_size = static_cast<int64_t>(size);
  return answer;
}

void RequireReachable(const int64_t* addresses, const int64_t* sizes, int64_t count, int device,
                      Reach reach, const char* side) {
  MemoryMap map(AskDriver);
  RequireReachableIn(map, addresses, sizes, count, device, reach, side);
}

}  // namespace kvoffload
