#include "cc/first_touch.h"

#include <errno.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

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

// 0 or an errno. Kernels before 5.14 lack MADV_POPULATE_WRITE: then an atomic add of
// zero per page faults it in for writing and keeps what another process wrote there.
int Populate(char* begin, int64_t bytes) {
  if (madvise(begin, bytes, MADV_POPULATE_WRITE) == 0) return 0;
  if (errno != EINVAL) return errno;
  for (int64_t at = 0; at < bytes; at += kPage) {
    __atomic_fetch_add(begin + at, 0, __ATOMIC_RELAXED);
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
  std::vector<std::thread> workers;
  workers.reserve(count);
  for (int i = 0; i < count; ++i) {
    workers.emplace_back([&, i] {
      if (!cpus.empty()) PinThisThread(cpus[i % cpus.size()]);
      if (edges[i + 1] > edges[i]) {
        errors[i] = Populate(reinterpret_cast<char*>(edges[i]), edges[i + 1] - edges[i]);
      }
    });
  }
  for (std::thread& worker : workers) worker.join();
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

}  // namespace kvoffload
