// ChooseDevicePath, IsLegacyStream and the path and reason names Python reports, over
// every reason and random stream handles.

#include "cc/copy/copy_path.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <string>

#include "cc/util/test_checks.h"

namespace kvoffload {
namespace {

constexpr int kReasons = 10;  // PathReason's values, kEmptyBatch to kStridedRows

// The order the choice is documented in: the caller's request, then the stream, then
// the driver.
PathReason ReferenceChoice(uintptr_t stream, bool entry_point, bool per_copy) {
  if (per_copy) return PathReason::kRequested;
  if (stream == 0 || stream == 1) return PathReason::kLegacyStream;
  return entry_point ? PathReason::kBatchEntryPoint : PathReason::kNoBatchEntryPoint;
}

void TestChooseDevicePath(std::mt19937_64& rng) {
  std::set<uintptr_t> streams{0, 1, 2, 3, 0x10, UINTPTR_MAX, UINTPTR_MAX - 1};
  while (streams.size() < 200) streams.insert(static_cast<uintptr_t>(rng()) >> (rng() % 64));
  for (uintptr_t stream : streams) {
    EXPECT(IsLegacyStream(stream) == (stream == 0 || stream == 1));
    for (bool entry_point : {false, true}) {
      for (bool per_copy : {false, true}) {
        EXPECT(ChooseDevicePath(stream, entry_point, per_copy) ==
               ReferenceChoice(stream, entry_point, per_copy));
      }
    }
  }
  // 0x2 is cudaStreamPerThread: not legacy, so the batch copy may take it.
  EXPECT(ChooseDevicePath(0x2, true, false) == PathReason::kBatchEntryPoint);
  EXPECT(ChooseDevicePath(0x0, true, false) == PathReason::kLegacyStream);
  EXPECT(ChooseDevicePath(0x1, false, false) == PathReason::kLegacyStream);
  EXPECT(ChooseDevicePath(0x1, false, true) == PathReason::kRequested);
  EXPECT(ChooseDevicePath(0x7f00, false, false) == PathReason::kNoBatchEntryPoint);
}

void TestPathsAndNames() {
  // Each reason's path and text, as the Python CopyResult shows them.
  const struct {
    PathReason reason;
    const char* path;
    const char* text;
  } table[kReasons] = {
      {PathReason::kEmptyBatch, "none", "empty batch"},
      {PathReason::kBatchEntryPoint, "batch", "driver batch copy available"},
      {PathReason::kRequested, "per_copy", "per-copy requested by the caller"},
      {PathReason::kLegacyStream, "per_copy", "legacy default stream, which the batch copy rejects"},
      {PathReason::kNoBatchEntryPoint, "per_copy", "driver has no cuMemcpyBatchAsync"},
      {PathReason::kDriverNotSupported, "per_copy",
       "driver answered CUDA_ERROR_NOT_SUPPORTED to the batch copy"},
      {PathReason::kHostToHost, "host", "host-to-host copy"},
      {PathReason::kKernelRequested, "kernel", "copy kernel requested"},
      {PathReason::kStagedRequested, "staged", "staged copy requested"},
      {PathReason::kStridedRows, "rows", "2D copies of tensors a constant stride apart in one allocation"},
  };
  std::set<std::string> texts;
  for (int r = 0; r < kReasons; ++r) {
    EXPECT(static_cast<int>(table[r].reason) == r);  // the table covers every reason
    EXPECT(std::strcmp(PathName(PathFor(table[r].reason)), table[r].path) == 0);
    EXPECT(std::strcmp(ReasonText(table[r].reason), table[r].text) == 0);
    texts.insert(ReasonText(table[r].reason));
  }
  EXPECT(texts.size() == kReasons);
  // Values past the enums name themselves "unknown" rather than another path.
  EXPECT(std::strcmp(ReasonText(static_cast<PathReason>(kReasons)), "unknown") == 0);
  EXPECT(std::strcmp(PathName(static_cast<CopyPath>(7)), "unknown") == 0);
  EXPECT(std::strcmp(PathName(CopyPath::kStaged), "staged") == 0);
}

void TestCopyResultDefaults() {
  const CopyResult r;
  EXPECT(r.reason == PathReason::kEmptyBatch && r.copies == 0 && r.bytes == 0 &&
         r.driver_calls == 0);
}

}  // namespace
}  // namespace kvoffload

int main() {
  std::mt19937_64 rng(777);
  kvoffload::TestChooseDevicePath(rng);
  kvoffload::TestPathsAndNames();
  kvoffload::TestCopyResultDefaults();
  return kvoffload::TestResult("copy_path_test");
}
