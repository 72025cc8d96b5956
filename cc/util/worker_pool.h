#ifndef KVOFFLOAD_CC_UTIL_WORKER_POOL_H_
#define KVOFFLOAD_CC_UTIL_WORKER_POOL_H_

// Host work split over a few threads that live as long as the process: a job's ids are
// hundreds of thousands of keys, and starting threads for each call cost more than the
// work itself.

#include <type_traits>

namespace kvoffload {

constexpr int kMaxSlices = 4;

// A borrowed callable work(int slice). Unlike std::function it never allocates, so a
// call that has begun cannot fail for want of memory.
class SliceWork {
 public:
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, SliceWork>>>
  SliceWork(const F& work)  // NOLINT: implicit, like std::function
      : work_(&work), call_([](const void* w, int s) { (*static_cast<const F*>(w))(s); }) {}
  void operator()(int slice) const { call_(work_, slice); }

 private:
  const void* work_;
  void (*call_)(const void*, int);
};

// Runs work(s) for every s in [0, slices), slices clamped to [1, kMaxSlices]: slice 0 on
// the calling thread, the others on the process's worker threads (started on first use,
// and again in a forked child). Slices run on the calling thread instead when the workers
// are busy with another caller, when called from inside a slice, or when no worker could
// be started. Returns when every slice has run, then rethrows the exception of the lowest
// slice that threw.
void RunSlices(int slices, SliceWork work);

// Slice s of `slices` over [0, length): [begin, end), the last one taking the remainder.
struct SliceBounds {
  long long begin, end;
};
inline SliceBounds SliceOf(long long length, int slices, int s) {
  return {length / slices * s, s + 1 == slices ? length : length / slices * (s + 1)};
}

// Slices for `count` items: 1 below `threshold`, else one per half of it, up to
// max_threads (0: kMaxSlices, or fewer on a machine with fewer cores).
int SlicesFor(long long count, long long threshold, int max_threads = 0);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_UTIL_WORKER_POOL_H_
