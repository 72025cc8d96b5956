#include "cc/copy/host_copy.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cc/util/start_gate.h"

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
  if (max_threads < 0) {
    throw std::invalid_argument("threads: must be >= 0, got " + std::to_string(max_threads));
  }
  if (max_threads == 0) {
    max_threads = std::min<int>(8, std::max(1u, std::thread::hardware_concurrency()));
  }
  if (total_bytes < kHostThreadingBytes) return 1;
  return std::min(max_threads, kMaxHostThreads);
}

// Throws std::invalid_argument naming two copies where a destination range overlaps any
// other range of the batch (split over threads, such copies tear; memcpy's own ranges
// may not overlap either). Sources may overlap each other.
void RequireNoOverlap(const CopyBatch& batch) {
  struct Range {
    int64_t begin, end, copy;
    bool dst;
  };
  std::vector<Range> ranges;
  ranges.reserve(2 * batch.count);
  for (int64_t i = 0; i < batch.count; ++i) {
    if (batch.size[i] == 0) continue;
    ranges.push_back({batch.src[i], batch.src[i] + batch.size[i], i, false});
    ranges.push_back({batch.dst[i], batch.dst[i] + batch.size[i], i, true});
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  const Range* furthest = nullptr;      // of the ranges so far, the one reaching furthest
  const Range* furthest_dst = nullptr;  // of the destinations so far
  auto name = [](const Range& r) { return std::string(r.dst ? "dst[" : "src[") + std::to_string(r.copy) + "]"; };
  for (const Range& r : ranges) {
    const Range* other = r.dst ? furthest : furthest_dst;
    if (other != nullptr && r.begin < other->end) {
      throw std::invalid_argument(name(*other) + " and " + name(r) +
                                  ": overlap; a destination may not overlap any other range of the batch");
    }
    if (furthest == nullptr || r.end > furthest->end) furthest = &r;
    if (r.dst && (furthest_dst == nullptr || r.end > furthest_dst->end)) furthest_dst = &r;
  }
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
    if (batch.size[i] > INT64_MAX - total) {
      throw std::invalid_argument("sizes: add up to more than 2^63 - 1 bytes");
    }
    total += batch.size[i];
  }
  result.bytes = total;
  RequireNoOverlap(batch);

  const int threads = ThreadCount(total, max_threads);
  result.driver_calls = threads;
  if (threads == 1) {
    CopyByteRange(batch, starts, 0, total);
    return result;
  }
  StartGate gate;
  std::vector<std::thread> workers;
  workers.reserve(threads);
  try {
    for (int t = 0; t < threads; ++t) {
      const int64_t begin = total / threads * t;
      const int64_t end = t + 1 == threads ? total : total / threads * (t + 1);
      workers.emplace_back([&, begin, end] {
        if (gate.Wait()) CopyByteRange(batch, starts, begin, end);
      });
    }
  } catch (const std::exception& e) {  // std::system_error, or std::bad_alloc
    gate.Open(false);
    for (std::thread& w : workers) w.join();
    throw std::runtime_error("threads: could not start thread " + std::to_string(workers.size()) +
                             " of " + std::to_string(threads) + " (" + e.what() +
                             "); nothing copied");
  }
  gate.Open(true);
  for (std::thread& w : workers) w.join();
  return result;
}

}  // namespace kvoffload
