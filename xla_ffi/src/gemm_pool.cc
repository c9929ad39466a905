// parallel_for for the GEMM/GEMV FFI calls and the bandwidth probe, on the one process-wide
// ThreadPool (thread_pool.h) that the MoE op uses too. Why not XLA's intra-op pool:
// scheduling one task there costs ~50-75 us (shared/NOTES.md), 10-15% of a 2048x7168 FP8
// GEMV. Why not a second pool of our own: its workers spun while the other pool's ran and
// took their cores (we measured the bandwidth probe slowing down beside a spinning MoE pool).
// Tasks are claimed through one atomic counter by the workers AND the caller, so the caller
// never waits for a task that no one has started.
#include <algorithm>
#include <atomic>

#include "gemm_kernels.h"
#include "thread_pool.h"

namespace hmoe {

int hardware_threads() { return ThreadPool::global().num_threads(); }

void parallel_for(int64_t n_tasks, int num_threads, const std::function<void(int64_t)>& fn) {
  if (n_tasks <= 0) return;
  const int threads = num_threads <= 0 ? hardware_threads() : num_threads;
  // One thread, one task, or a call from inside a region: run() itself runs fn(0) inline,
  // and fn(0) takes every task from the counter.
  std::atomic<int64_t> next{0};
  ThreadPool::global().run(static_cast<int>(std::min<int64_t>(threads, n_tasks)), [&](int) {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < n_tasks;) fn(t);
  });
}

}  // namespace hmoe
