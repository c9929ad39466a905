// Executes a MoePlan on the persistent thread pool: gate/up tasks, per-expert barriers,
// down tasks, and the weighted combination into y, with no global barrier in the fine
// schedule (the coarse one has two, for the ablation).
#pragma once

#include <cstdint>
#include <string>

#include "cpu_features.h"
#include "moe_gemv.h"
#include "moe_plan.h"

namespace hmoe {

// One layer's stacked routed experts; expert e's matrices are views at e * stride.
struct MoeLayerWeights {
  WeightFormat format = WeightFormat::kFp8;
  int64_t group_size = 0;  // INT4 only
  const uint8_t* q[3] = {nullptr, nullptr, nullptr};  // gate [E, I, *], up [E, I, *], down [E, D, *]
  const uint8_t* s[3] = {nullptr, nullptr, nullptr};  // their scales
  int64_t q_stride_bytes[3] = {0, 0, 0};  // bytes between experts
  int64_t s_stride_bytes[3] = {0, 0, 0};
  int64_t n[3] = {0, 0, 0}, k[3] = {0, 0, 0};  // logical [N, K] of one expert's matrix

  ExpertMatrix matrix(int which, int64_t expert) const {
    ExpertMatrix m;
    m.format = format;
    m.q = q[which] + expert * q_stride_bytes[which];
    m.scale = s[which] + expert * s_stride_bytes[which];
    m.n = n[which];
    m.k = k[which];
    m.group_size = group_size;
    return m;
  }
};

struct MoeExecOptions {
  Isa isa = Isa::kPortable;
  int num_threads = 0;  // 0: the whole pool
};

// x: [m, d] f32 (x_f32) or bf16 (x_bf16, the other null); topk_w: [m, k] f32;
// y: [m, d] f32, y[t] = sum_j topk_w[t, j] * down(silu(gate x_t) * up x_t) of expert ids[t, j].
void run_moe(const MoePlan& plan, const MoeLayerWeights& w, const float* x_f32,
             const uint16_t* x_bf16, const float* topk_w, float* y, const MoeExecOptions& opt);

// Threads a run with these options uses (the pool's size caps num_threads).
int threads_used(const MoeExecOptions& opt);

// Bytes of weights (values + scales) of the plan's active experts: each is read once.
int64_t active_weight_bytes(const MoePlan& plan, const MoeLayerWeights& w);

}  // namespace hmoe
