#include "moe_exec.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "thread_pool.h"

namespace hmoe {
namespace {

// Activation scratch reused across calls (grow-only): at M=512 the per-pair buffers are
// ~100 MiB and fresh pages would cost a page fault per 4 KiB on every call. Guarded by
// the mutex because XLA may run two MoE calls concurrently.
struct Scratch {
  std::mutex mu;
  PackedX x_tok;  // [M, Dp] packed bf16 tokens (Dp = packed_x_stride(D)), 64-byte aligned
  PackedX x_pair;  // [P, Dp] packed rows, in sorted pair order
  PackedX h;  // [P, Ip] packed bf16 silu(gate) * up: the down projection's input
  std::vector<float> out;  // [P, D] f32 down projection per pair, before weighting
};
Scratch& scratch() {
  static Scratch* s = new Scratch;  // leaked: no teardown order issues at exit
  return *s;
}

template <typename T, typename A>
T* grow(std::vector<T, A>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

}  // namespace

int threads_used(const MoeExecOptions& opt) {
  const int pool = ThreadPool::global().num_threads();
  return opt.num_threads > 0 ? std::min(opt.num_threads, pool) : pool;
}

int64_t active_weight_bytes(const MoePlan& plan, const MoeLayerWeights& w) {
  int64_t per_expert = 0;
  for (int which = 0; which < 3; ++which) per_expert += expert_matrix_bytes(w.matrix(which, 0));
  return per_expert * static_cast<int64_t>(plan.experts.size());
}

void run_moe(const MoePlan& plan, const MoeLayerWeights& w, const float* x_f32,
             const uint16_t* x_bf16, const float* topk_w, float* y, const MoeExecOptions& opt) {
  const int64_t m = plan.m, k = plan.k, d = plan.d, inter = plan.inter;
  const int64_t pairs = m * k;
  const int64_t num_active = static_cast<int64_t>(plan.experts.size());
  const Isa isa = opt.isa;

  Scratch& sc = scratch();
  std::lock_guard<std::mutex> lock(sc.mu);
  // x -> packed bf16 once per token (the kernels' activation layout), then each pair's row
  // is a copy of its token's packed row.
  const int64_t xs = packed_x_stride(d), hs = packed_x_stride(inter);
  uint16_t* x_tok = grow(sc.x_tok, static_cast<size_t>(m * xs));
  if (x_f32) pack_x_f32(isa, w.format, x_f32, m, d, d, x_tok);
  else pack_x_bf16(isa, w.format, x_bf16, m, d, d, x_tok);
  uint16_t* x_pair = grow(sc.x_pair, static_cast<size_t>(pairs * xs));
  for (int64_t p = 0; p < pairs; ++p)
    std::memcpy(x_pair + p * xs, x_tok + int64_t{plan.pair_token[p]} * xs, xs * sizeof(uint16_t));
  uint16_t* h = grow(sc.h, static_cast<size_t>(pairs * hs));
  float* out = grow(sc.out, static_cast<size_t>(pairs * d));

  const size_t num_queues = plan.queues.size();
  const size_t num_slices = plan.down_slices.size() - 1;
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[num_queues]);
  for (size_t q = 0; q < num_queues; ++q) next[q].store(0);
  std::unique_ptr<std::atomic<int32_t>[]> gu_done(new std::atomic<int32_t>[num_active]);
  for (int64_t a = 0; a < num_active; ++a) gu_done[a].store(0);
  std::unique_ptr<std::atomic<int32_t>[]> slice_done(new std::atomic<int32_t>[num_slices]);
  for (size_t s = 0; s < num_slices; ++s) slice_done[s].store(0);
  std::atomic<int32_t> gu_total{0};
  const bool fine = plan.schedule == MoeSchedule::kFine;

  // The weighted combination of output slice s, run by whichever thread finishes the last
  // down task of that slice: no reduction pass, no atomics on y, and a fixed summation
  // order (slot j = 0..k-1), so every schedule produces the same bits.
  auto combine = [&](size_t s) {
    const int64_t d0 = plan.down_slices[s], d1 = plan.down_slices[s + 1];
    for (int64_t t = 0; t < m; ++t) {
      float* yt = y + t * d;
      for (int64_t j = 0; j < k; ++j) {
        const float wt = topk_w[t * k + j];
        const float* o = out + int64_t{plan.pair_of[t * k + j]} * d;
        if (j == 0)
          for (int64_t c = d0; c < d1; ++c) yt[c] = wt * o[c];
        else
          for (int64_t c = d0; c < d1; ++c) yt[c] += wt * o[c];
      }
    }
  };

  auto gate_up = [&](const MoeTask& task, std::vector<float>& g, std::vector<float>& u) {
    const int64_t a = task.expert, e = plan.experts[a];
    const int64_t r0 = plan.row_begin[a], rows = plan.row_begin[a + 1] - r0;
    // [rows, I] f32 per thread; this task fills columns [n0, n1).
    float* gp = grow(g, static_cast<size_t>(rows * inter));
    float* up = grow(u, static_cast<size_t>(rows * inter));
    expert_gemv(w.matrix(0, e), isa, x_pair + r0 * xs, rows, task.n0, task.n1, gp, inter);
    expert_gemv(w.matrix(1, e), isa, x_pair + r0 * xs, rows, task.n0, task.n1, up, inter);
    for (int64_t r = 0; r < rows; ++r)
      silu_mul_pack(isa, w.format, gp + r * inter + task.n0, up + r * inter + task.n0, task.n0,
                    task.n1, inter, h + (r0 + r) * hs);
    gu_done[a].fetch_add(1, std::memory_order_release);
    gu_total.fetch_add(1, std::memory_order_release);
  };

  auto down = [&](const MoeTask& task) {
    const int64_t a = task.expert, e = plan.experts[a];
    const int64_t r0 = plan.row_begin[a], rows = plan.row_begin[a + 1] - r0;
    // The per-expert barrier (fine) or the global one (coarse). Every awaited task has been
    // claimed already (queue order, moe_plan.h), so this only waits for running work.
    uint32_t spins = 0;
    if (fine) {
      while (gu_done[a].load(std::memory_order_acquire) < plan.gate_up_tasks[a]) cpu_relax(spins);
    } else {
      while (gu_total.load(std::memory_order_acquire) < plan.total_gate_up_tasks) cpu_relax(spins);
    }
    expert_gemv(w.matrix(2, e), isa, h + r0 * hs, rows, task.n0, task.n1, out + r0 * d, d);
    if (slice_done[task.slice].fetch_add(1, std::memory_order_acq_rel) + 1 == num_active)
      combine(static_cast<size_t>(task.slice));
  };

  ThreadPool& pool = ThreadPool::global();
  const int threads = threads_used(opt);
  pool.run(threads, [&](int tid) {
    thread_local std::vector<float> g, u;
    // A thread drains its own node's queue first, then helps the others (a node may have
    // no active expert, or no thread when numa_nodes > threads).
    const size_t home = static_cast<size_t>(node_of_thread(tid, threads, plan.numa_nodes)) % num_queues;
    for (size_t qi = 0; qi < num_queues; ++qi) {
      const size_t q = (home + qi) % num_queues;
      const auto& tasks = plan.queues[q];
      for (;;) {
        const int64_t i = next[q].fetch_add(1, std::memory_order_relaxed);
        if (i >= static_cast<int64_t>(tasks.size())) break;
        if (tasks[i].kind == MoeTask::kGateUp) gate_up(tasks[i], g, u);
        else down(tasks[i]);
      }
    }
  });
}

}  // namespace hmoe
