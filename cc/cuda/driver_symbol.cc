#include "cc/cuda/driver_symbol.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "cc/cuda/cuda_check.h"

namespace kvoffload {

void* ResolveDriverSymbol(const char* symbol, unsigned int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t status =
      cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &found);
  if (found == cudaDriverEntryPointSymbolNotFound ||
      found == cudaDriverEntryPointVersionNotSufficent) {
    cudaGetLastError();  // an absent symbol is an answer, not a pending error
    return nullptr;
  }
  CheckCuda(status, "cudaGetDriverEntryPointByVersion");
  return fn;
}

std::string DriverErrorName(int status) {
  static const auto error_name =
      reinterpret_cast<PFN_cuGetErrorName_v6000>(ResolveDriverSymbol("cuGetErrorName", 6000));
  const char* name = nullptr;
  if (error_name != nullptr && error_name(static_cast<CUresult>(status), &name) == CUDA_SUCCESS &&
      name != nullptr) {
    return name;
  }
  return "CUresult " + std::to_string(status);
}

}  // namespace kvoffload
