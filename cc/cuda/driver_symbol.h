#ifndef KVOFFLOAD_CC_CUDA_DRIVER_SYMBOL_H_
#define KVOFFLOAD_CC_CUDA_DRIVER_SYMBOL_H_

// Driver entry points resolved at run time, never linked, so a driver without one is
// a named fallback rather than a load failure.

#include <string>

namespace kvoffload {

// The driver function `symbol` in the form of CUDA `version` (e.g. 13000), resolved at
// run time through the runtime's entry point query, never linked; nullptr when the
// driver lacks it. Throws CudaError when the query itself fails.
void* ResolveDriverSymbol(const char* symbol, unsigned int version);

// The driver's name for a CUresult ("CUDA_ERROR_INVALID_VALUE").
std::string DriverErrorName(int status);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_CUDA_DRIVER_SYMBOL_H_
