// Tasks shared out over PyTorch's OpenMP threads as they come free, not split into equal shares up front: a thread
// slowed by something else on its core (another process, the hypervisor, a later wake-up) takes fewer tasks, so the
// others do not wait for it at the end of the call. Runs of consecutive tasks shrink as the tasks run out (OpenMP's
// guided schedule): large runs at first keep each thread on consecutive tasks (a GEMM's weights read once per
// thread), single tasks at the end leave no thread idle for longer than one. Which thread runs a task never changes
// its result.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace zoo {

// body(begin, end) for runs of tasks covering [0, count) once each, on up to at::get_num_threads() threads (on the
// calling thread alone inside a parallel region, as at::parallel_for runs then).
template <typename F>
void share_tasks(int64_t count, const F& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1 || omp_in_parallel()) {
    if (count > 0) body(int64_t{0}, count);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < count) {
      const int64_t run = std::max<int64_t>(1, (count - begin) / (2 * threads));
      if (next.compare_exchange_weak(begin, begin + run, std::memory_order_relaxed)) {
        body(begin, begin + run);
        begin = next.load(std::memory_order_relaxed);
      }
    }
  }
}

}  // namespace zoo
