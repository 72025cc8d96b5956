#ifndef KVOFFLOAD_CC_COPY_WARP_COPY_H_
#define KVOFFLOAD_CC_COPY_WARP_COPY_H_

// The device side of every SM copy: one warp moves one piece. CUDA code only.

#include <cstdint>

namespace kvoffload {

constexpr int kWarpSize = 32;
constexpr int kLoadsInFlight = 8;

// One warp copies elements [begin, end), each lane with kLoadsInFlight loads in flight
// before its first store.
template <typename T>
__device__ inline void WarpCopyElements(const T* src, T* dst, int64_t begin, int64_t end, int lane) {
  for (int64_t base = begin; base < end; base += kWarpSize * kLoadsInFlight) {
    T r[kLoadsInFlight];
#pragma unroll
    for (int k = 0; k < kLoadsInFlight; ++k) {
      const int64_t i = base + k * kWarpSize + lane;
      if (i < end) r[k] = src[i];
    }
#pragma unroll
    for (int k = 0; k < kLoadsInFlight; ++k) {
      const int64_t i = base + k * kWarpSize + lane;
      if (i < end) dst[i] = r[k];
    }
  }
}

// One warp copies n bytes. Where source and destination share their offset modulo 16,
// a byte head brings both to 16-byte alignment and the body moves in 16-byte vectors;
// the rest (all of it for misaligned pairs) moves byte by byte.
__device__ inline void WarpCopy(const char* src, char* dst, int64_t n, int lane) {
  const uintptr_t s = reinterpret_cast<uintptr_t>(src);
  int64_t done = 0;
  if (((s ^ reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const int64_t to_boundary = static_cast<int64_t>((16 - (s & 15)) & 15);
    const int64_t head = n < to_boundary ? n : to_boundary;
    if (lane < head) dst[lane] = src[lane];
    const int64_t vectors = (n - head) >> 4;
    WarpCopyElements(reinterpret_cast<const int4*>(src + head), reinterpret_cast<int4*>(dst + head),
                     0, vectors, lane);
    done = head + (vectors << 4);
  }
  WarpCopyElements(src, dst, done, n, lane);
}

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_COPY_WARP_COPY_H_
