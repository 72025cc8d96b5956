#ifndef KVOFFLOAD_CC_UTIL_START_GATE_H_
#define KVOFFLOAD_CC_UTIL_START_GATE_H_

// Lets workers begin only once every one of them has started: a thread that fails to
// start then leaves nothing half-done. A future rather than a condition variable:
// std::condition_variable::wait is a GCC 12 libstdc++ symbol (GLIBCXX_3.4.30), which
// would lift the extension's manylinux tag to 2_35.

#include <future>

namespace kvoffload {

class StartGate {
 public:
  // Blocks until Open(go); returns go.
  bool Wait() { return opened_.get(); }
  void Open(bool go) { decision_.set_value(go); }

 private:
  std::promise<bool> decision_;
  std::shared_future<bool> opened_ = decision_.get_future().share();
};

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_UTIL_START_GATE_H_
