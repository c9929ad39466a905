#include "moe_plan.h"

#include <algorithm>

namespace hmoe {
namespace {

void add_slices(int64_t n, int64_t width, std::vector<int64_t>* bounds) {
  bounds->clear();
  for (int64_t c = 0; c < n; c += width) bounds->push_back(c);
  bounds->push_back(n);
}

}  // namespace

std::string build_moe_plan(const int32_t* ids, int64_t m, int64_t k, int64_t d, int64_t inter,
                           int64_t num_experts, const MoePlanOptions& opt, MoePlan* plan) {
  if (opt.numa_nodes < 1) return "numa_nodes must be >= 1, got " + std::to_string(opt.numa_nodes);
  // gate/up slices end on 64-element chunks of the packed down input (moe_gemv.h).
  if (opt.gate_up_slice < 64 || opt.gate_up_slice % 64 != 0 || opt.down_slice < 1)
    return "gate_up_slice must be a positive multiple of 64 and down_slice >= 1, got " +
           std::to_string(opt.gate_up_slice) + " and " + std::to_string(opt.down_slice);
  MoePlan& p = *plan;
  p.m = m, p.k = k, p.d = d, p.inter = inter, p.num_experts = num_experts;
  p.schedule = opt.schedule;
  p.numa_nodes = opt.numa_nodes;

  // Counting sort of the (token, slot) pairs by expert id: stable, so the rows of an
  // expert are in token order and every schedule sees the same row layout.
  std::vector<int64_t> count(num_experts + 1, 0);
  for (int64_t i = 0; i < m * k; ++i) {
    const int32_t e = ids[i];
    if (e < 0 || e >= num_experts)
      return "ids[" + std::to_string(i / k) + ", " + std::to_string(i % k) + "] = " +
             std::to_string(e) + " is out of range [0, " + std::to_string(num_experts) + ")";
    ++count[e + 1];
  }
  p.experts.clear();
  p.row_begin.assign(1, 0);
  std::vector<int32_t> active_of(num_experts, -1);
  for (int64_t e = 0; e < num_experts; ++e) {
    if (count[e + 1] == 0) continue;
    active_of[e] = static_cast<int32_t>(p.experts.size());
    p.experts.push_back(static_cast<int32_t>(e));
    p.row_begin.push_back(p.row_begin.back() + count[e + 1]);
  }
  const int64_t num_active = static_cast<int64_t>(p.experts.size());
  std::vector<int64_t> fill(p.row_begin.begin(), p.row_begin.end() - 1);
  p.pair_token.assign(m * k, 0);
  p.pair_of.assign(m * k, 0);
  for (int64_t i = 0; i < m * k; ++i) {
    const int64_t row = fill[active_of[ids[i]]]++;
    p.pair_token[row] = static_cast<int32_t>(i / k);
    p.pair_of[i] = static_cast<int32_t>(row);
  }

  // NUMA ownership: the expert axis is split into contiguous blocks, one per node (as a
  // loader would place a layer's experts); a node's threads run its experts' tasks first.
  const int nodes = opt.numa_nodes;
  p.expert_node.resize(num_active);
  for (int64_t a = 0; a < num_active; ++a)
    p.expert_node[a] = static_cast<int32_t>(int64_t{p.experts[a]} * nodes / num_experts);

  const bool fine = opt.schedule == MoeSchedule::kFine;
  std::vector<int64_t> gu_bounds;
  add_slices(inter, fine ? opt.gate_up_slice : inter, &gu_bounds);
  add_slices(d, fine ? opt.down_slice : d, &p.down_slices);

  // Coarse: one queue (a global barrier spans all of it, see moe_exec.cc).
  p.queues.assign(fine ? nodes : 1, {});
  p.gate_up_tasks.assign(num_active, 0);
  p.total_gate_up_tasks = 0;
  for (int64_t a = 0; a < num_active; ++a) {
    auto& q = p.queues[fine ? p.expert_node[a] : 0];
    for (size_t s = 0; s + 1 < gu_bounds.size(); ++s) {
      q.push_back({MoeTask::kGateUp, static_cast<int32_t>(a), static_cast<int32_t>(gu_bounds[s]),
                   static_cast<int32_t>(gu_bounds[s + 1]), -1});
      ++p.gate_up_tasks[a];
      ++p.total_gate_up_tasks;
    }
  }
  // Down tasks after all gate/up tasks of their queue: by the time a thread claims the
  // down of expert a, every gate/up task of a has been claimed (hence started), so waiting
  // for them never waits on work that has not begun (shared/NOTES.md).
  for (int64_t a = 0; a < num_active; ++a) {
    auto& q = p.queues[fine ? p.expert_node[a] : 0];
    for (size_t s = 0; s + 1 < p.down_slices.size(); ++s)
      q.push_back({MoeTask::kDown, static_cast<int32_t>(a), static_cast<int32_t>(p.down_slices[s]),
                   static_cast<int32_t>(p.down_slices[s + 1]), static_cast<int32_t>(s)});
  }
  return {};
}

}  // namespace hmoe
