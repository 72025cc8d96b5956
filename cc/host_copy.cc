#include "cc/host_copy.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace kvoffload {
namespace {

// Copies bytes [begin, end) of the batch's concatenated byte stream.
void CopyByteRange(const CopyBatch& batch, const std::vector<int64_t>& starts, int64_t begin,
                   int64_t end) {
  int64_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  while (begin < end) {
    const int64_t offset = begin - starts[i];
    const int64_t n = std::min(batch.size[i] - offset, end - begin);
    std::memcpy(reinterpret_cast<char*>(batch.dst[i]) + offset,
                reinterpret_cast<const char*>(batch.src[i]) + offset, n);
    begin += n;
    ++i;
  }
}

int ThreadCount(int64_t total_bytes, int max_threads) {
  if (max_threads <= 0) {
    max_threads = std::min<int>(8, std::max(1u, std::thread::hardware_concurrency()));
  }
  if (total_bytes < kHostThreadingBytes) return 1;
  return max_threads;
}

}  // namespace

CopyResult HostCopy(const CopyBatch& batch, int max_threads) {
  ValidateCopyBatch(batch);
  CopyResult result;
  if (batch.count == 0) return result;
  result.reason = PathReason::kHostToHost;
  result.copies = batch.count;

  std::vector<int64_t> starts(batch.count);
  int64_t total = 0;
  for (int64_t i = 0; i < batch.count; ++i) {
    starts[i] = total;
    total += batch.size[i];
  }
  result.bytes = total;

  const int threads = ThreadCount(total, max_threads);
  result.driver_calls = threads;
  if (threads == 1) {
    CopyByteRange(batch, starts, 0, total);
    return result;
  }
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = total / threads * t;
    const int64_t end = t + 1 == threads ? total : total / threads * (t + 1);
    workers.emplace_back([&, begin, end] { CopyByteRange(batch, starts, begin, end); });
  }
  for (std::thread& w : workers) w.join();
  return result;
}

}  // namespace kvoffload
