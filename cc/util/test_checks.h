#ifndef KVOFFLOAD_CC_UTIL_TEST_CHECKS_H_
#define KVOFFLOAD_CC_UTIL_TEST_CHECKS_H_

// The checks of the C++ tests: a plain main runs the test functions, EXPECT counts the
// failures, and TestResult turns them into the exit status.

#include <cstdio>
#include <stdexcept>
#include <string>

namespace kvoffload {

inline int failures = 0;

#define EXPECT(cond)                                                          \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #cond); \
      ++::kvoffload::failures;                                                \
    }                                                                         \
  } while (0)

// Whether f throws std::invalid_argument with `needle` in its message.
template <typename F>
bool Rejects(F f, const std::string& needle) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) return true;
    std::fprintf(stderr, "unexpected message: %s (wanted %s)\n", e.what(), needle.c_str());
    return false;
  }
  return false;
}

// The message of the E that f throws, or "(no exception)".
template <typename E, typename F>
std::string MessageOf(F f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no exception)";
}

template <typename F>
std::string InvalidArgument(F f) {
  return MessageOf<std::invalid_argument>(f);
}

// main's exit status: 0 when no check failed.
inline int TestResult(const char* test) {
  if (failures) {
    std::fprintf(stderr, "%s: %d failures\n", test, failures);
    return 1;
  }
  std::printf("%s: all passed\n", test);
  return 0;
}

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_UTIL_TEST_CHECKS_H_
