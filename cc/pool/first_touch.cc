#include "cc/pool/first_touch.h"

#include <errno.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "cc/util/start_gate.h"

namespace kvoffload {
namespace {

constexpr int64_t kPage = 4096;
// Slices start on 2 MiB boundaries, so no two threads fault the same huge page.
constexpr int64_t kSliceAlign = int64_t{2} << 20;
constexpr int64_t kMinSliceBytes = int64_t{64} << 20;
constexpr int kMpolPreferred = 1;  // <numaif.h> is not installed everywhere
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

void RequireRange(int64_t address, int64_t bytes) {
  if (address <= 0 || address % kPage != 0) {
    throw std::invalid_argument("address: must be a positive multiple of 4096, got " +
                                std::to_string(address));
  }
  if (bytes <= 0) throw std::invalid_argument("bytes: must be > 0, got " + std::to_string(bytes));
}

std::atomic<testing::MadviseFunction> madvise_for_testing{nullptr};

int Madvise(char* begin, int64_t bytes, int advice) {
  const testing::MadviseFunction function = madvise_for_testing.load();
  return function != nullptr ? function(begin, bytes, advice) : madvise(begin, bytes, advice);
}

// The end of the slice that starts at `at`: kPopulateSliceBytes on, cut back to a 2 MiB
// boundary (no two calls fault one huge page), and no further than `stop`.
int64_t SliceEnd(int64_t at, int64_t stop) {
  int64_t end = at + kPopulateSliceBytes;
  if (end - end % kSliceAlign > at) end -= end % kSliceAlign;
  return std::min(end, stop);
}

// 0 or an errno, faulting in at most kPopulateSliceBytes a call. Kernels before 5.14
// lack MADV_POPULATE_WRITE: then an atomic add of zero per page faults it in for
// writing and keeps what another process wrote there.
int Populate(char* begin, int64_t bytes) {
  const int64_t first = reinterpret_cast<int64_t>(begin), last = first + bytes;
  bool fallback = false;
  for (int64_t at = first; at < last;) {
    const int64_t end = SliceEnd(at, last);
    char* slice = reinterpret_cast<char*>(at);
    if (!fallback && Madvise(slice, end - at, MADV_POPULATE_WRITE) != 0) {
      if (errno != EINVAL) return errno;
      fallback = true;
    }
    if (fallback) {
      for (int64_t page = 0; page < end - at; page += kPage) {
        __atomic_fetch_add(slice + page, 0, __ATOMIC_RELAXED);
      }
    }
    at = end;
  }
  return 0;
}

void PinThisThread(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  // A CPU taken away since the caller listed it leaves the thread unpinned: slower, not wrong.
  sched_setaffinity(0, sizeof(set), &set);
}

}  // namespace

void TouchPages(int64_t address, int64_t bytes, const std::vector<int>& cpus, int threads) {
  RequireRange(address, bytes);
  if (threads < 1) throw std::invalid_argument("threads: must be >= 1, got " + std::to_string(threads));
  for (int cpu : cpus) {
    if (cpu < 0 || cpu >= CPU_SETSIZE) {
      throw std::invalid_argument("cpus: " + std::to_string(cpu) + " is not a CPU number");
    }
  }
  const int64_t end = address + bytes;
  const int64_t by_size = std::max<int64_t>(1, bytes / kMinSliceBytes);
  const int count = static_cast<int>(std::min<int64_t>(threads, by_size));
  std::vector<int64_t> edges(count + 1, end);
  edges[0] = address;
  for (int i = 1; i < count; ++i) {
    const int64_t at = address + bytes / count * i;
    edges[i] = std::max(edges[i - 1], at - at % kSliceAlign);
  }
  std::vector<int> errors(count, 0);
  // The threads start touching only once all have started: one that cannot start
  // leaves the pool untouched.
  StartGate gate;
  std::vector<std::thread> workers;
  workers.reserve(count);
  auto join = [&](bool go) {
    gate.Open(go);
    for (std::thread& worker : workers) worker.join();
  };
  for (int i = 0; i < count; ++i) {
    try {
      workers.emplace_back([&, i] {
        if (!gate.Wait()) return;
        if (!cpus.empty()) PinThisThread(cpus[i % cpus.size()]);
        if (edges[i + 1] > edges[i]) {
          errors[i] = Populate(reinterpret_cast<char*>(edges[i]), edges[i + 1] - edges[i]);
        }
      });
    } catch (const std::system_error& e) {
      join(/*go=*/false);
      throw std::system_error(e.code(), "first touch: could not start thread " + std::to_string(i + 1) +
                                            " of " + std::to_string(count) +
                                            " (RLIMIT_AS or RLIMIT_NPROC?); nothing was touched");
    }
  }
  join(/*go=*/true);
  for (int i = 0; i < count; ++i) {
    if (errors[i] != 0) {
      throw std::system_error(errors[i], std::generic_category(),
                              "touching bytes [" + std::to_string(edges[i] - address) + ", " +
                                  std::to_string(edges[i + 1] - address) + ") of the pool");
    }
  }
}

void PreferNumaNode(int64_t address, int64_t bytes, int node) {
  RequireRange(address, bytes);
  constexpr int kMaxNodes = 1024;
  if (node < 0 || node >= kMaxNodes) {
    throw std::invalid_argument("node: must be in [0, 1024), got " + std::to_string(node));
  }
  unsigned long mask[kMaxNodes / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] = 1UL << (node % (8 * sizeof(unsigned long)));
  const int64_t length = (bytes + kPage - 1) / kPage * kPage;
  if (syscall(SYS_mbind, address, length, kMpolPreferred, mask, kMaxNodes, 0) != 0) {
    throw std::system_error(errno, std::generic_category(),
                            "mbind(MPOL_PREFERRED, node " + std::to_string(node) + ")");
  }
}

namespace testing {
void SetMadviseForTesting(MadviseFunction function) { madvise_for_testing.store(function); }
}  // namespace testing

}  // namespace kvoffload
