// A small persistent thread pool for the GEMM FFI calls (and the MoE op, if it wants it).
// Why not XLA's intra-op pool: scheduling one task there costs ~50-75 us (NOTES), which
// is 10-15% of a 2048x7168 FP8 GEMV. Why not OpenMP: it stalls when a neighbour holds a
// core. Workers spin briefly for the next job (decode issues calls back to back), then
// sleep on a condition variable. Tasks are claimed through one atomic counter by the
// workers AND the caller, so the caller never waits for a task that no one has started.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "gemm_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HMOE_PAUSE() _mm_pause()
#else
#define HMOE_PAUSE() ((void)0)
#endif

namespace hmoe {
namespace {

thread_local bool in_pool_task = false;

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // leaked on purpose: workers outlive static dtors
    return *pool;
  }

  void run(int64_t n_tasks, int threads, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> serial(call_mu_);
    const int helpers = static_cast<int>(std::min<int64_t>(threads - 1, n_tasks - 1));
    ensure_workers(helpers);
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_tasks_ = n_tasks;
      next_.store(0, std::memory_order_relaxed);
      done_.store(0, std::memory_order_relaxed);
      active_helpers_ = helpers;
      closed_ = false;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work(fn, n_tasks);
    // Every claimed task is running on some thread: wait for them; then close the job so
    // no late worker joins it, and wait for the helpers that joined to leave.
    for (int spin = 0; done_.load(std::memory_order_acquire) < n_tasks; ++spin) relax(spin);
    {
      std::lock_guard<std::mutex> lk(mu_);
      closed_ = true;
    }
    for (int spin = 0; busy_.load(std::memory_order_acquire) != 0; ++spin) relax(spin);
  }

 private:
  // Spin briefly, then yield: on a shared machine the thread we wait for may need our core.
  static void relax(int spin) {
    if (spin < 2000)
      HMOE_PAUSE();
    else
      std::this_thread::yield();
  }

  void work(const std::function<void(int64_t)>& fn, int64_t n_tasks) {
    in_pool_task = true;
    for (;;) {
      const int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
      if (t >= n_tasks) break;
      fn(t);
      done_.fetch_add(1, std::memory_order_release);
    }
    in_pool_task = false;
  }

  void ensure_workers(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      const int id = static_cast<int>(workers_.size());
      workers_.emplace_back([this, id] { loop(id); });
      workers_.back().detach();
    }
  }

  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      // Spin ~20-50 us for the next job (decode issues calls back to back), then sleep.
      for (int spin = 0; spin < 20000; ++spin) {
        if (generation_.load(std::memory_order_acquire) != seen) break;
        HMOE_PAUSE();
      }
      const std::function<void(int64_t)>* fn = nullptr;
      int64_t n_tasks = 0;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        seen = generation_.load(std::memory_order_relaxed);
        // Join only open jobs, and only the first `active_helpers_` workers (num_threads).
        if (closed_ || id >= active_helpers_) continue;
        busy_.fetch_add(1, std::memory_order_acq_rel);
        fn = fn_;
        n_tasks = n_tasks_;
      }
      work(*fn, n_tasks);
      busy_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0}, done_{0};
  std::atomic<int> busy_{0};
  // Guarded by mu_: the current job.
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  int active_helpers_ = 0;
  bool closed_ = true;
};

}  // namespace

int hardware_threads() {
  static const int n = std::max(1u, std::thread::hardware_concurrency());
  return n;
}

void parallel_for(int64_t n_tasks, int num_threads, const std::function<void(int64_t)>& fn) {
  if (n_tasks <= 0) return;
  const int threads = num_threads <= 0 ? hardware_threads() : num_threads;
  if (threads == 1 || n_tasks == 1 || in_pool_task) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  Pool::get().run(n_tasks, threads, fn);
}

}  // namespace hmoe
