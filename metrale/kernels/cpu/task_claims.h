// Tasks that a kernel's threads claim as they come free, instead of a fixed share each.
//
// at::parallel_for gives each of the pool's threads a fixed share of the range: with as many
// threads as cores, a thread the OS stops for a moment (the API process writing a stream, the
// load's client reading it) holds every other one at the region's end, for the whole of its
// delay. Here a thread claims a run of tasks at a time, each a share of what is left ("guided"
// scheduling: a quarter of the tasks first with two threads, then shorter runs), so a thread that
// is stopped leaves the rest to the others, and the runs stay long enough to read the weights in
// order as the memory's prefetchers expect.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace metrale_cpu {

class TaskClaims {
 public:
  TaskClaims(int64_t tasks, int64_t threads, int64_t grain)
      : tasks_(tasks), threads_(threads), grain_(grain) {}

  // The next run of tasks [begin, end), at least `grain` long but the last; false once none is
  // left.
  bool next(int64_t& begin, int64_t& end) {
    int64_t first = next_.load(std::memory_order_relaxed);
    int64_t last = 0;
    do {
      if (first >= tasks_) return false;
      const int64_t run = std::max(grain_, (tasks_ - first) / (2 * threads_));
      last = std::min(tasks_, first + run);
    } while (!next_.compare_exchange_weak(first, last, std::memory_order_relaxed));
    begin = first;
    end = last;
    return true;
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t tasks_;
  const int64_t threads_;
  const int64_t grain_;
};

// body(claims) runs once on each thread of the pool, at most one a `grain` of tasks (on the
// caller alone inside another parallel region, with one thread, or with a grain of tasks or
// fewer), and claims tasks until none is left.
template <typename Body>
void parallel_claims(int64_t tasks, int64_t grain, const Body& body) {
  if (tasks <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (tasks + grain - 1) / grain);
  TaskClaims claims(tasks, threads, grain);
  if (threads <= 1 || at::in_parallel_region()) {
    body(claims);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(claims); });
}

// at::parallel_for(0, tasks, grain, fn) with the runs claimed: fn(begin, end) over each.
template <typename Fn>
void parallel_for_claimed(int64_t tasks, int64_t grain, const Fn& fn) {
  parallel_claims(tasks, grain, [&](TaskClaims& claims) {
    int64_t begin = 0, end = 0;
    while (claims.next(begin, end)) fn(begin, end);
  });
}

}  // namespace metrale_cpu
