// The worker pool: every slice runs exactly once, from many threads at once, nested, after
// an exception and in a forked child; the lowest slice's exception is the one rethrown.

#include "cc/util/worker_pool.h"

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cc/util/test_checks.h"

// Allocations made while `counting` is set, on any thread.
std::atomic<bool> counting{false};
std::atomic<int> allocations{0};

void* operator new(std::size_t bytes) {
  if (counting) ++allocations;
  if (void* p = std::malloc(bytes ? bytes : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace kvoffload {
namespace {

// Runs `slices` slices, each adding its number plus one to its own counter; whether
// every slice in the clamped range ran once and no other did.
bool RunsEachSliceOnce(int slices) {
  std::array<std::atomic<int>, kMaxSlices + 1> runs{};
  std::atomic<int> outside{0};
  RunSlices(slices, [&](int s) {
    if (s < 0 || s >= kMaxSlices) {
      ++outside;
      return;
    }
    runs[s] += s + 1;
  });
  const int want = std::max(1, std::min(slices, kMaxSlices));
  bool ok = outside == 0;
  for (int s = 0; s <= kMaxSlices; ++s) ok = ok && runs[s] == (s < want ? s + 1 : 0);
  return ok;
}

void RunsEverySliceOnce() {
  for (int slices = -1; slices <= kMaxSlices + 3; ++slices) EXPECT(RunsEachSliceOnce(slices));
}

void RethrowsTheLowestSlicesExceptionAfterAllRan() {
  std::mt19937_64 rng(7);
  for (int n = 0; n < 200; ++n) {
    const int slices = std::uniform_int_distribution<int>(1, kMaxSlices)(rng);
    const unsigned throwing = std::uniform_int_distribution<unsigned>(0, (1u << slices) - 1)(rng);
    std::atomic<int> ran{0};
    std::string got = MessageOf<std::runtime_error>([&] {
      RunSlices(slices, [&](int s) {
        ++ran;
        if (throwing & (1u << s)) throw std::runtime_error("slice " + std::to_string(s));
      });
    });
    int lowest = -1;
    for (int s = slices - 1; s >= 0; --s) {
      if (throwing & (1u << s)) lowest = s;
    }
    EXPECT(got == (lowest < 0 ? "(no exception)" : "slice " + std::to_string(lowest)));
    EXPECT(ran == slices);
  }
  EXPECT(RunsEachSliceOnce(kMaxSlices));  // the pool still works
}

void ManyCallersAtOnce() {
  std::atomic<int> wrong{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 8; ++t) {
    callers.emplace_back([&, t] {
      for (int n = 0; n < 500; ++n) {
        if (!RunsEachSliceOnce(1 + (n + t) % kMaxSlices)) ++wrong;
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  EXPECT(wrong == 0);
}

void NestedCallsDoNotWait() {
  std::array<std::atomic<int>, kMaxSlices> inner_ok{};
  RunSlices(kMaxSlices, [&](int s) { inner_ok[s] = RunsEachSliceOnce(kMaxSlices) ? 1 : 0; });
  for (const std::atomic<int>& ok : inner_ok) EXPECT(ok == 1);
}

void AForkedChildRunsItsOwnSlices() {
  EXPECT(RunsEachSliceOnce(kMaxSlices));  // the parent's workers exist
  const pid_t child = fork();
  if (child == 0) _exit(RunsEachSliceOnce(kMaxSlices) && RunsEachSliceOnce(2) ? 0 : 1);
  int status = -1;
  EXPECT(child > 0 && waitpid(child, &status, 0) == child);
  EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// Once the workers exist, a call allocates nothing: a job's checks, between marking and
// clearing their bits, cannot fail for want of memory.
void RunningSlicesAllocatesNothing() {
  RunSlices(kMaxSlices, [](int) {});  // the pool exists
  std::array<std::atomic<int>, kMaxSlices> runs{};
  std::array<int64_t, 64> big_capture{};  // more than any small-buffer optimisation holds
  counting = true;
  for (int n = 0; n < 100; ++n) {
    RunSlices(1 + n % kMaxSlices, [&runs, big_capture](int s) { runs[s] += 1 + static_cast<int>(big_capture[s]); });
  }
  counting = false;
  EXPECT(allocations == 0);
  EXPECT(runs[0] == 100 && runs[kMaxSlices - 1] == 25);
}

void SlicesForCounts() {
  EXPECT(SlicesFor(0, 100, 4) == 1);
  EXPECT(SlicesFor(99, 100, 4) == 1);
  EXPECT(SlicesFor(100, 100, 4) == 2);
  EXPECT(SlicesFor(150, 100, 4) == 3);
  EXPECT(SlicesFor(1 << 30, 100, 4) == 4);
  EXPECT(SlicesFor(1 << 30, 100, 3) == 3);
  EXPECT(SlicesFor(1 << 30, 100, 99) == kMaxSlices);
  EXPECT(SlicesFor(1 << 30, 100, 0) >= 1 && SlicesFor(1 << 30, 100, 0) <= kMaxSlices);
}

}  // namespace
}  // namespace kvoffload

int main() {
  kvoffload::RunsEverySliceOnce();
  kvoffload::RethrowsTheLowestSlicesExceptionAfterAllRan();
  kvoffload::ManyCallersAtOnce();
  kvoffload::NestedCallsDoNotWait();
  kvoffload::AForkedChildRunsItsOwnSlices();
  kvoffload::RunningSlicesAllocatesNothing();
  kvoffload::SlicesForCounts();
  return kvoffload::TestResult("worker_pool_test");
}
