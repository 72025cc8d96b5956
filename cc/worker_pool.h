#ifndef KVOFFLOAD_CC_WORKER_POOL_H_
#define KVOFFLOAD_CC_WORKER_POOL_H_

// Host work split over a few threads that live as long as the process: a job's ids are
// hundreds of thousands of keys, and starting threads for each call cost more than the
// work itself.

#include <functional>

namespace kvoffload {

constexpr int kMaxSlices = 4;

// Runs work(s) for every s in [0, slices), slices clamped to [1, kMaxSlices]: slice 0 on
// the calling thread, the others on the process's worker threads (started on first use).
// Slices run on the calling thread instead when the workers are busy with another
// caller (or this one: nested calls never wait), were never started (thread creation
// failed), or belong to the parent of a forked process. Returns when every slice has
// run, then rethrows the exception of the lowest slice that threw.
void RunSlices(int slices, const std::function<void(int)>& work);

// Slices for `count` items: 1 below `threshold`, else one per half of it, up to
// max_threads (0: kMaxSlices, or fewer on a machine with fewer cores).
int SlicesFor(long long count, long long threshold, int max_threads = 0);

}  // namespace kvoffload

#endif  // KVOFFLOAD_CC_WORKER_POOL_H_
