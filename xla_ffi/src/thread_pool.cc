#include "thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hmoe {
namespace {
thread_local bool in_region_flag = false;

// Runs fn(tid) with the in-region flag set, restoring it after (also on exceptions).
void run_marked(const std::function<void(int)>& fn, int tid) {
  struct Mark {
    bool prev = in_region_flag;
    Mark() { in_region_flag = true; }
    ~Mark() { in_region_flag = prev; }
  } mark;
  fn(tid);
}
}  // namespace

void cpu_relax(uint32_t& spins) {
  // ~2000 pauses is a few microseconds; past that the awaited thread is probably not on a
  // core, so give ours away.
  if (++spins < 2000) {
#if defined(__x86_64__)
    _mm_pause();
#endif
  } else {
    std::this_thread::yield();
  }
}

ThreadPool::ThreadPool(int num_threads, int spin_us) : spin_us_(std::max(0, spin_us)) {
  const int n = std::max(1, num_threads);
  workers_.reserve(n - 1);
  for (int tid = 1; tid < n; ++tid) workers_.emplace_back([this, tid] { worker_loop(tid); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(sleep_mu_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  sleep_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int tid) {
  uint64_t seen = generation_.load();
  for (;;) {
    uint64_t g = generation_.load();
    if (g == seen) {
      // Spin first (the next region usually follows within microseconds during decode),
      // then sleep until the caller publishes a new generation.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      uint32_t spins = 0;
      while ((g = generation_.load()) == seen && std::chrono::steady_clock::now() < deadline) {
        if (++spins >= 64) {
          spins = 0;
          std::this_thread::yield();
        }
#if defined(__x86_64__)
        _mm_pause();
#endif
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lk(sleep_mu_);
        sleepers_.fetch_add(1);
        sleep_cv_.wait(lk, [&] { return generation_.load() != seen; });
        sleepers_.fetch_sub(1);
      }
      continue;
    }
    if (stop_.load()) return;
    // Join: announce first, then check that the region is still open (the caller closes
    // first, then waits for active_ == 0, so one of the two sees the other).
    active_.fetch_add(1);
    seen = generation_.load();
    if (!closed_.load() && tid < region_threads_) run_marked(*fn_, tid);
    active_.fetch_sub(1);
  }
}

void ThreadPool::run(int n_threads, const std::function<void(int)>& fn) {
  const int n = std::min(num_threads(), std::max(1, n_threads));
  if (n == 1 || in_region_flag) {
    run_marked(fn, 0);
    return;
  }
  std::lock_guard<std::mutex> region(run_mu_);
  fn_ = &fn;
  region_threads_ = n;
  closed_.store(false);
  generation_.fetch_add(1);
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lk(sleep_mu_);
    sleep_cv_.notify_all();
  }
  run_marked(fn, 0);
  closed_.store(true);
  uint32_t spins = 0;
  while (active_.load() != 0) cpu_relax(spins);
}

ThreadPool& ThreadPool::global() {
  static ThreadPool* pool = [] {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("HMOE_NUM_THREADS")) n = std::atoi(env);
    int spin_us = 200;
    if (const char* env = std::getenv("HMOE_SPIN_US")) spin_us = std::atoi(env);
    // Leaked on purpose: joining workers from a static destructor at interpreter exit
    // races with XLA's own teardown.
    return new ThreadPool(std::max(1, n), spin_us);
  }();
  return *pool;
}

}  // namespace hmoe
