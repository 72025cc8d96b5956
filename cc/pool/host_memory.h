#ifndef KVOFFLOAD_CC_POOL_HOST_MEMORY_H_
#define KVOFFLOAD_CC_POOL_HOST_MEMORY_H_

// Page-locking of host memory a caller gives a pool (host_buffer), and whether an address
// is already page-locked.

#include <cstdint>

namespace kvoffload {

// Page-locks [address, address + bytes) for DMA (cudaHostRegister). Throws CudaError.
void HostRegister(int64_t address, int64_t bytes);

// Undoes HostRegister. Throws CudaError.
void HostUnregister(int64_t address);

// Whether CUDA knows `address` as page-locked host memory.
bool IsPinnedHost(int64_t address);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_POOL_HOST_MEMORY_H_
