#include "cc/util/worker_pool.h"

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>

namespace kvoffload {
namespace {

// pthread's condition variable: std::condition_variable::wait is a GCC 12 libstdc++ symbol
// (GLIBCXX_3.4.30), which would lift the extension's manylinux tag to 2_35.
class Condition {
 public:
  Condition() { pthread_cond_init(&cond_, nullptr); }
  template <typename Ready>
  void Wait(std::unique_lock<std::mutex>& lock, Ready ready) {
    while (!ready()) pthread_cond_wait(&cond_, lock.mutex()->native_handle());
  }
  void NotifyAll() { pthread_cond_broadcast(&cond_); }

 private:
  pthread_cond_t cond_;
};

using Errors = std::array<std::exception_ptr, kMaxSlices>;

// Whether this thread is running a slice (or handing them out): a nested call runs inline.
thread_local bool in_slices = false;

void RunOne(const SliceWork& work, int s, Errors& errors) {
  try {
    work(s);
  } catch (...) {
    errors[s] = std::current_exception();
  }
}

// Never destroyed: its detached workers may still wait on its condition variables while
// static destructors run at exit.
class Pool {
 public:
  // Starts the workers (once this pool is the process's: a pool that lost the race to be
  // it is deleted before it has any).
  void Start() {
    for (int w = 1; w < kMaxSlices; ++w) {
      try {
        std::thread(&Pool::Work, this, w).detach();
      } catch (const std::exception&) {  // std::system_error: run the rest inline
        break;
      }
      workers_.store(w, std::memory_order_release);
    }
  }

  // False when another call holds the pool: the caller runs every slice itself.
  bool TryRun(int slices, const SliceWork& work, Errors& errors) {
    std::unique_lock<std::mutex> caller(caller_, std::try_to_lock);
    if (!caller.owns_lock()) return false;
    const int on_workers = std::min(slices - 1, workers_.load(std::memory_order_acquire));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      work_ = &work;
      errors_ = &errors;
      on_workers_ = on_workers;
      pending_ = on_workers;
      ++generation_;
    }
    start_.NotifyAll();
    for (int s = on_workers + 1; s < slices; ++s) RunOne(work, s, errors);
    RunOne(work, 0, errors);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.Wait(lock, [&] { return pending_ == 0; });
    work_ = nullptr;
    return true;
  }

 private:
  void Work(int w) {
    in_slices = true;
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      start_.Wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (w > on_workers_) continue;
      const SliceWork& work = *work_;
      Errors& errors = *errors_;
      lock.unlock();
      RunOne(work, w, errors);
      lock.lock();
      if (--pending_ == 0) done_.NotifyAll();
    }
  }

  std::atomic<int> workers_{0};
  std::mutex caller_;  // one call at a time uses the workers
  std::mutex mutex_;
  Condition start_, done_;
  uint64_t generation_ = 0;
  int on_workers_ = 0, pending_ = 0;
  const SliceWork* work_ = nullptr;
  Errors* errors_ = nullptr;
};

std::atomic<Pool*> process_pool{nullptr};

Pool& ThisProcessPool() {
  Pool* current = process_pool.load(std::memory_order_acquire);
  if (current != nullptr) return *current;
  // A forked child has none of its parent's threads: it forgets the parent's pool (and
  // leaks it) and starts one of its own on first use.
  static std::once_flag at_fork;
  std::call_once(at_fork, [] {
    pthread_atfork(nullptr, nullptr, [] { process_pool.store(nullptr, std::memory_order_relaxed); });
  });
  Pool* fresh = new Pool();
  if (!process_pool.compare_exchange_strong(current, fresh, std::memory_order_acq_rel)) {
    delete fresh;  // another thread's came first
    return *current;
  }
  fresh->Start();
  return *fresh;
}

}  // namespace

int SlicesFor(long long count, long long threshold, int max_threads) {
  if (max_threads <= 0) {
    max_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }
  max_threads = std::clamp(max_threads, 1, kMaxSlices);
  if (count < threshold) return 1;
  return static_cast<int>(std::min<long long>(max_threads, 2 * count / threshold));
}

void RunSlices(int slices, SliceWork work) {
  slices = std::clamp(slices, 1, kMaxSlices);
  Errors errors;
  bool ran = false;
  if (slices > 1 && !in_slices) {
    in_slices = true;
    try {
      ran = ThisProcessPool().TryRun(slices, work, errors);
    } catch (...) {  // std::bad_alloc making the pool: nothing ran
      in_slices = false;
      throw;
    }
    in_slices = false;
  }
  if (!ran) {
    for (int s = 0; s < slices; ++s) RunOne(work, s, errors);
  }
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

}  // namespace kvoffload
