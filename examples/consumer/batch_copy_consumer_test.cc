// Links the batch copy from another workspace: the host path moves bytes, and the
// device path either copies or reports that there is no CUDA device.

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "cc/copy/batch_copy.h"
#include "cc/copy/host_copy.h"
#include "cc/cuda/cuda_error.h"

int main() {
  std::mt19937 gen(7);
  std::vector<uint8_t> src(1 << 16), dst(1 << 16, 0xA5);
  for (uint8_t& b : src) b = static_cast<uint8_t>(gen());
  std::vector<int64_t> s, d, n;
  for (int64_t i = 0; i < 16; ++i) {
    s.push_back(reinterpret_cast<int64_t>(src.data()) + i * 4096);
    d.push_back(reinterpret_cast<int64_t>(dst.data()) + (15 - i) * 4096);
    n.push_back(4096);
  }
  const kvoffload::CopyBatch batch{s.data(), d.data(), n.data(), 16};
  kvoffload::HostCopy(batch);
  for (int64_t i = 0; i < 16; ++i) {
    for (int64_t j = 0; j < 4096; ++j) {
      if (dst[(15 - i) * 4096 + j] != src[i * 4096 + j]) {
        std::fprintf(stderr, "host copy: byte %lld of block %lld differs\n",
                     static_cast<long long>(j), static_cast<long long>(i));
        return 1;
      }
    }
  }
  try {
    kvoffload::BatchEntryPointVersion();
    std::printf("a CUDA device is present\n");
  } catch (const kvoffload::NoCudaDeviceError& e) {
    std::printf("as expected without a GPU: %s\n", e.what());
  }
  std::printf("1 passed, 0 failed\n");
  return 0;
}
