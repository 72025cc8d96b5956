// First touch faults a range in madvise calls of at most kPopulateSliceBytes (a call holds
// the process's mmap lock throughout), that cover the range once, end on 2 MiB boundaries
// and keep what the pages hold; and it reports a failed call.

#include "cc/pool/first_touch.h"

#include <errno.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <system_error>
#include <utility>
#include <vector>

#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

std::mutex calls_mutex;
std::vector<std::pair<int64_t, int64_t>> calls;  // (address, bytes) of each populate call
int fail_with = 0;  // an errno the stand-in returns instead of calling madvise

int RecordingMadvise(void* address, size_t bytes, int advice) {
  {
    std::lock_guard<std::mutex> lock(calls_mutex);
    if (advice == MADV_POPULATE_WRITE) calls.emplace_back(reinterpret_cast<int64_t>(address), bytes);
  }
  if (fail_with != 0) {
    errno = fail_with;
    return -1;
  }
  return madvise(address, bytes, advice);
}

struct Mapping {
  explicit Mapping(int64_t bytes) : bytes(bytes) {
    void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    base = at == MAP_FAILED ? nullptr : static_cast<char*>(at);
  }
  ~Mapping() {
    if (base != nullptr) munmap(base, bytes);
  }
  int64_t bytes;
  char* base;
};

void PopulatesInSmallSlicesThatCoverTheRangeOnce() {
  Mapping map(600 * kMiB);
  EXPECT(map.base != nullptr);
  // An unaligned start and end, and two threads of about 300 MiB each.
  const int64_t aligned = (reinterpret_cast<int64_t>(map.base) + 2 * kMiB - 1) / (2 * kMiB) * (2 * kMiB);
  const int64_t start = aligned + 5 * 4096, bytes = 590 * kMiB - 3 * 4096;
  reinterpret_cast<char*>(start)[0] = 7;
  reinterpret_cast<char*>(start)[bytes - 1] = 9;
  calls.clear();
  fail_with = 0;
  testing::SetMadviseForTesting(&RecordingMadvise);
  TouchPages(start, bytes, {}, 2);
  testing::SetMadviseForTesting(nullptr);
  std::sort(calls.begin(), calls.end());
  EXPECT(static_cast<int64_t>(calls.size()) >= bytes / kPopulateSliceBytes);
  int64_t at = start;
  for (const auto& [address, size] : calls) {
    EXPECT(size > 0 && size <= kPopulateSliceBytes);
    EXPECT(address == at);  // no gap, no overlap
    at = address + size;
    EXPECT(at == start + bytes || at % (2 * kMiB) == 0);
  }
  EXPECT(at == start + bytes);
  EXPECT(reinterpret_cast<char*>(start)[0] == 7 && reinterpret_cast<char*>(start)[bytes - 1] == 9);
  unsigned char resident[16];
  EXPECT(mincore(reinterpret_cast<void*>(aligned + 300 * kMiB), 16 * 4096, resident) == 0);
  EXPECT(std::all_of(resident, resident + 16, [](unsigned char r) { return r & 1; }));
}

void AFailedCallIsReportedWithItsBytes() {
  Mapping map(128 * kMiB);
  calls.clear();
  fail_with = ENOMEM;
  testing::SetMadviseForTesting(&RecordingMadvise);
  const std::string message = MessageOf<std::system_error>(
      [&] { TouchPages(reinterpret_cast<int64_t>(map.base), 128 * kMiB, {}, 1); });
  testing::SetMadviseForTesting(nullptr);
  fail_with = 0;
  EXPECT(message.find("touching bytes [0, 134217728) of the pool") != std::string::npos);
  EXPECT(calls.size() == 1);  // stopped at the first failed slice
}

void OldKernelsFallBackToTouchingEachPage() {
  Mapping map(8 * kMiB);
  calls.clear();
  fail_with = EINVAL;  // no MADV_POPULATE_WRITE before Linux 5.14
  testing::SetMadviseForTesting(&RecordingMadvise);
  TouchPages(reinterpret_cast<int64_t>(map.base), 8 * kMiB, {}, 1);
  testing::SetMadviseForTesting(nullptr);
  fail_with = 0;
  std::vector<unsigned char> resident(8 * kMiB / 4096);
  EXPECT(mincore(map.base, 8 * kMiB, resident.data()) == 0);
  EXPECT(std::all_of(resident.begin(), resident.end(), [](unsigned char r) { return r & 1; }));
}

}  // namespace
}  // namespace kvoffload

int main() {
  kvoffload::PopulatesInSmallSlicesThatCoverTheRangeOnce();
  kvoffload::AFailedCallIsReportedWithItsBytes();
  kvoffload::OldKernelsFallBackToTouchingEachPage();
  return kvoffload::TestResult("first_touch_test");
}
