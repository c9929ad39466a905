// Our one persistent CPU thread pool, shared by the GEMM/GEMV calls (parallel_for,
// gemm_pool.cc) and the MoE op: two pools would each spin for the other's cores. No OpenMP:
// it stalls badly when a neighbour holds a core (shared/NOTES.md). One parallel region at a
// time: `run(n, fn)` calls fn(tid) on n threads, tid 0 being the caller itself. Workers
// spin for a short while after each region (decode calls arrive back to back, a futex wake
// costs tens of microseconds) and then sleep.
//
// The pool never makes a thread wait for a region to *start* on another thread: callers
// hand out work through their own atomic task counters, so a worker that wakes late finds
// nothing left and leaves; `run` returns once every thread that did join has left (they
// are running, so that wait is short), never waiting for a thread that is still asleep.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace hmoe {

class ThreadPool {
 public:
  // `num_threads` counts the caller: a pool of n has n - 1 worker threads.
  explicit ThreadPool(int num_threads, int spin_us = 200);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(tid) for tid in [0, n) with n = min(num_threads, max(1, n_threads)); tid 0 on
  // the calling thread. fn must take its work from shared atomic counters (see above): a
  // thread may join after all work is gone, or (if it slept) not at all. Regions from
  // different callers are serialised.
  // Called from inside a region (a task that itself calls run), fn(0) runs inline on the
  // calling thread: the other threads are busy with the outer region.
  void run(int n_threads, const std::function<void(int tid)>& fn);

  // The process-wide pool, sized by HMOE_NUM_THREADS or std::thread::hardware_concurrency.
  static ThreadPool& global();

 private:
  void worker_loop(int tid);

  std::vector<std::thread> workers_;
  const int spin_us_;
  std::mutex run_mu_;  // one region at a time

  // Region state, published by `generation_` (release) and read by workers (acquire).
  const std::function<void(int)>* fn_ = nullptr;
  int region_threads_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> closed_{true};  // set when the caller is done: late joiners skip
  std::atomic<int> active_{0};      // workers inside fn right now

  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

// Spin-wait helper for short waits on work that is known to be running on another thread.
// After `spins` pause iterations it yields the core (on 2 shared cores the thread we wait
// for may be descheduled behind us).
void cpu_relax(uint32_t& spins);

}  // namespace hmoe
