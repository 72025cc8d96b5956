#ifndef KVOFFLOAD_CC_POOL_PINNED_POOL_H_
#define KVOFFLOAD_CC_POOL_PINNED_POOL_H_

// A host pool's registrations: page-locked for every device, safe beside a graph capture.

#include <cstdint>

namespace kvoffload {

// The CUDA side of a host pool. Every call makes `device` current for its duration only
// and runs in relaxed stream-capture mode, so a pool can be pinned on one thread while
// another captures a CUDA graph. Failures throw CudaError.

// Page-locks one registration (a range) of a pool for every device, mapped (cudaHostRegisterPortable | Mapped).
void PoolRegister(int64_t address, int64_t bytes, int device);

// Undoes PoolRegister.
void PoolUnregister(int64_t address, int device);

// Whether `device` supports cudaHostRegister (cudaDevAttrHostRegisterSupported).
bool HostRegisterSupported(int device);

// The host NUMA node closest to `device`, or -1 where unknown.
int HostNumaNode(int device);

// cudaHostAlloc(bytes, portable | mapped), the fallback where registration is unsupported.
int64_t PoolHostAlloc(int64_t bytes, int device);

// cudaFreeHost.
void PoolFreeHost(int64_t address, int device);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_POOL_PINNED_POOL_H_
