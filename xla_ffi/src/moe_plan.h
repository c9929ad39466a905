// The host-side plan of one fused MoE call: plain data, built from the routing ids alone,
// executed by moe_exec. Three steps, as in the paper: split by NUMA node -> expert -> output
// slice.
//
// Token/expert pairs are sorted by expert (stable in token order), so each active expert's
// tokens form one contiguous block of rows [row_begin[e], row_begin[e + 1]) in the gathered
// activations, the bf16 intermediate and the per-pair output: one GEMV per (expert, slice)
// reads the expert's weights once for all its tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hmoe {

enum class MoeSchedule : int {
  kFine = 0,    // tasks (expert, output slice); down of an expert waits for its own gate/up
  kCoarse = 1,  // one task per expert and phase; global barrier between gate/up and down
};

struct MoeTask {
  enum Kind : int32_t { kGateUp = 0, kDown = 1 };
  int32_t kind;
  int32_t expert;  // index into MoePlan::experts (active experts), not the expert id
  int32_t n0, n1;  // output columns: [i0, i1) of I for gate/up, [d0, d1) of D for down
  int32_t slice;   // down only: index of [d0, d1) in MoePlan::down_slices
};

struct MoePlanOptions {
  MoeSchedule schedule = MoeSchedule::kFine;
  int numa_nodes = 1;
  int64_t gate_up_slice = 128;  // columns of I per gate/up task (fine)
  int64_t down_slice = 256;     // columns of D per down task (fine)
};

struct MoePlan {
  int64_t m = 0, k = 0, d = 0, inter = 0, num_experts = 0;
  MoeSchedule schedule = MoeSchedule::kFine;
  int numa_nodes = 1;

  std::vector<int32_t> experts;    // [A] distinct active expert ids, ascending
  std::vector<int64_t> row_begin;  // [A + 1] row offsets of each active expert's pairs
  std::vector<int32_t> pair_token;  // [M * k] token of sorted pair p
  std::vector<int32_t> pair_of;     // [M * k] sorted pair index of (t, j) = t * k + j
  std::vector<int32_t> expert_node;  // [A] NUMA node owning active expert a

  std::vector<std::vector<MoeTask>> queues;  // [numa_nodes] tasks, gate/up before down
  std::vector<int32_t> gate_up_tasks;  // [A] gate/up tasks of each active expert
  int32_t total_gate_up_tasks = 0;
  std::vector<int64_t> down_slices;  // [S + 1] column boundaries of D
};

// Builds the plan; returns an empty string or a one-line error naming the operand.
// ids: [m, k] int32 expert ids, each in [0, num_experts).
std::string build_moe_plan(const int32_t* ids, int64_t m, int64_t k, int64_t d, int64_t inter,
                           int64_t num_experts, const MoePlanOptions& opt, MoePlan* plan);

// NUMA node of a thread: threads are split into contiguous groups, one per node.
inline int node_of_thread(int tid, int num_threads, int numa_nodes) {
  return static_cast<int>(static_cast<int64_t>(tid) * numa_nodes / num_threads);
}

}  // namespace hmoe
