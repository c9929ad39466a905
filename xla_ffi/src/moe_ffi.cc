// XLA FFI adapter of the fused routed-MoE op `hmoe_moe_experts`: validates the buffers
// (errors name the operand, expected vs actual), builds the plan, runs it. The handler
// receives the whole layer's stacked expert arrays plus the ids, so no expert weight is
// ever sliced or copied per call; `stats` echoes the weight buffer pointers XLA handed us
// so tests can prove that.
#include <cstdint>
#include <string>

#include "cpu_features.h"
#include "moe_exec.h"
#include "moe_plan.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hmoe {
namespace {

// stats layout (int64 [kStatsLen]).
enum Stat : int {
  kPtrGateQ = 0, kPtrUpQ, kPtrDownQ, kPtrGateS, kPtrUpS, kPtrDownS,
  kActiveExperts, kActiveWeightBytes, kIsaUsed, kThreadsUsed,
  kQueues, kNode0Experts, kTasks, kStatsLen
};

std::string dims_str(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

std::string expect_dims(const char* name, ffi::AnyBuffer::Dimensions got,
                        std::initializer_list<int64_t> want) {
  bool ok = got.size() == want.size();
  size_t i = 0;
  for (int64_t w : want) ok = ok && got[i++] == w;
  if (ok) return {};
  std::string s = "[";
  i = 0;
  for (int64_t w : want) s += (i++ ? ", " : "") + std::to_string(w);
  return std::string(name) + ": expected shape " + s + "], got " + dims_str(got);
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

ffi::Error MoeExpertsImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> topk_w,
                          ffi::AnyBuffer gate_q, ffi::AnyBuffer gate_s, ffi::AnyBuffer up_q,
                          ffi::AnyBuffer up_s, ffi::AnyBuffer down_q, ffi::AnyBuffer down_s,
                          ffi::Result<ffi::Buffer<ffi::F32>> y, ffi::Result<ffi::Buffer<ffi::S32>> stats,
                          int64_t weight_format, int64_t group_size, int64_t schedule,
                          int64_t numa_nodes, int64_t max_isa, int64_t num_threads,
                          int64_t gate_up_slice, int64_t down_slice) {
  auto bad = [](const std::string& msg) { return ffi::Error::InvalidArgument("hmoe_moe_experts: " + msg); };
  if (x.dimensions().size() != 2) return bad("x: expected rank 2 [M, D], got " + dims_str(x.dimensions()));
  const int64_t m = x.dimensions()[0], d = x.dimensions()[1];
  if (x.element_type() != ffi::F32 && x.element_type() != ffi::BF16)
    return bad("x: expected dtype float32 or bfloat16");
  if (ids.dimensions().size() != 2 || ids.dimensions()[0] != m)
    return bad("ids: expected shape [" + std::to_string(m) + ", k], got " + dims_str(ids.dimensions()));
  const int64_t k = ids.dimensions()[1];
  if (k < 1) return bad("ids: k must be >= 1, got shape " + dims_str(ids.dimensions()));
  if (auto e = expect_dims("weights", topk_w.dimensions(), {m, k}); !e.empty()) return bad(e);
  if (gate_q.dimensions().size() != 3)
    return bad("gate: expected rank 3 [E, I, D], got " + dims_str(gate_q.dimensions()));
  const int64_t num_experts = gate_q.dimensions()[0], inter = gate_q.dimensions()[1];
  if (schedule != 0 && schedule != 1) return bad("schedule: expected 0 (fine) or 1 (coarse), got " + std::to_string(schedule));

  MoeLayerWeights w;
  ffi::AnyBuffer* qs[3] = {&gate_q, &up_q, &down_q};
  ffi::AnyBuffer* ss[3] = {&gate_s, &up_s, &down_s};
  const char* names[3] = {"gate", "up", "down"};
  const int64_t ns[3] = {inter, inter, d}, ks[3] = {d, d, inter};
  if (weight_format == static_cast<int64_t>(WeightFormat::kFp8)) {
    w.format = WeightFormat::kFp8;
    for (int i = 0; i < 3; ++i) {
      const std::string qn = std::string(names[i]) + ".w", sn = std::string(names[i]) + ".scale_inv";
      if (qs[i]->element_type() != ffi::F8E4M3FN && qs[i]->element_type() != ffi::U8)
        return bad(qn + ": expected dtype float8_e4m3fn (or its uint8 bits)");
      if (auto e = expect_dims(qn.c_str(), qs[i]->dimensions(), {num_experts, ns[i], ks[i]}); !e.empty())
        return bad(e);
      if (ss[i]->element_type() != ffi::F32) return bad(sn + ": expected dtype float32");
      const int64_t nb = cdiv(ns[i], 128), kb = cdiv(ks[i], 128);
      if (auto e = expect_dims(sn.c_str(), ss[i]->dimensions(), {num_experts, nb, kb}); !e.empty())
        return bad(e);
      w.q_stride_bytes[i] = ns[i] * ks[i];
      w.s_stride_bytes[i] = nb * kb * 4;
    }
  } else if (weight_format == static_cast<int64_t>(WeightFormat::kInt4)) {
    w.format = WeightFormat::kInt4;
    w.group_size = group_size;
    for (int i = 0; i < 3; ++i) {
      const std::string qn = std::string(names[i]) + ".q", sn = std::string(names[i]) + ".scale";
      if (group_size < 1 || ks[i] % group_size != 0)
        return bad(std::string(names[i]) + ": K=" + std::to_string(ks[i]) +
                   " must be a multiple of group_size=" + std::to_string(group_size));
      if (qs[i]->element_type() != ffi::U8) return bad(qn + ": expected dtype uint8 (packed int4)");
      if (auto e = expect_dims(qn.c_str(), qs[i]->dimensions(), {num_experts, ns[i], ks[i] / 2}); !e.empty())
        return bad(e);
      if (ss[i]->element_type() != ffi::BF16) return bad(sn + ": expected dtype bfloat16");
      const int64_t ng = ks[i] / group_size;
      if (auto e = expect_dims(sn.c_str(), ss[i]->dimensions(), {num_experts, ns[i], ng}); !e.empty())
        return bad(e);
      w.q_stride_bytes[i] = ns[i] * (ks[i] / 2);
      w.s_stride_bytes[i] = ns[i] * ng * 2;
    }
  } else {
    return bad("weight_format: expected 0 (fp8) or 1 (int4), got " + std::to_string(weight_format));
  }
  for (int i = 0; i < 3; ++i) {
    w.q[i] = static_cast<const uint8_t*>(qs[i]->untyped_data());
    w.s[i] = static_cast<const uint8_t*>(ss[i]->untyped_data());
    w.n[i] = ns[i];
    w.k[i] = ks[i];
    if (auto e = check_expert_matrix(w.matrix(i, 0)); !e.empty()) return bad(std::string(names[i]) + ": " + e);
  }
  if (auto e = expect_dims("y", y->dimensions(), {m, d}); !e.empty()) return bad(e);
  if (auto e = expect_dims("stats", stats->dimensions(), {2 * kStatsLen}); !e.empty()) return bad(e);

  MoePlanOptions popt;
  popt.schedule = static_cast<MoeSchedule>(schedule);
  popt.numa_nodes = static_cast<int>(numa_nodes);
  popt.gate_up_slice = gate_up_slice;
  popt.down_slice = down_slice;
  MoePlan plan;
  if (auto e = build_moe_plan(ids.typed_data(), m, k, d, inter, num_experts, popt, &plan); !e.empty())
    return bad(e);

  MoeExecOptions eopt;
  eopt.isa = gemm_isa(select_isa(static_cast<int>(max_isa)));  // the path the kernels really run
  eopt.num_threads = static_cast<int>(num_threads);
  const bool is_f32 = x.element_type() == ffi::F32;
  run_moe(plan, w, is_f32 ? static_cast<const float*>(x.untyped_data()) : nullptr,
          is_f32 ? nullptr : static_cast<const uint16_t*>(x.untyped_data()), topk_w.typed_data(),
          y->typed_data(), eopt);

  // int64 values as (lo, hi) int32 words: jax without x64 has no int64 outputs.
  int64_t st[kStatsLen];
  for (int i = 0; i < 3; ++i) {
    st[kPtrGateQ + i] = reinterpret_cast<int64_t>(qs[i]->untyped_data());
    st[kPtrGateS + i] = reinterpret_cast<int64_t>(ss[i]->untyped_data());
  }
  st[kActiveExperts] = static_cast<int64_t>(plan.experts.size());
  st[kActiveWeightBytes] = active_weight_bytes(plan, w);
  st[kIsaUsed] = static_cast<int64_t>(eopt.isa);
  st[kThreadsUsed] = threads_used(eopt);
  // The plan's shape, so tests can see that the schedule / NUMA split really happened.
  st[kQueues] = static_cast<int64_t>(plan.queues.size());
  st[kNode0Experts] = 0;
  for (int32_t node : plan.expert_node) st[kNode0Experts] += node == 0;
  st[kTasks] = 0;
  for (const auto& q : plan.queues) st[kTasks] += static_cast<int64_t>(q.size());
  int32_t* words = stats->typed_data();
  for (int i = 0; i < kStatsLen; ++i) {
    const uint64_t v = static_cast<uint64_t>(st[i]);
    words[2 * i] = static_cast<int32_t>(static_cast<uint32_t>(v));
    words[2 * i + 1] = static_cast<int32_t>(static_cast<uint32_t>(v >> 32));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeExperts, MoeExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [M, D] f32 | bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [M, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [M, k]
                                  .Arg<ffi::AnyBuffer>()  // gate.w
                                  .Arg<ffi::AnyBuffer>()  // gate.scale
                                  .Arg<ffi::AnyBuffer>()  // up.w
                                  .Arg<ffi::AnyBuffer>()  // up.scale
                                  .Arg<ffi::AnyBuffer>()  // down.w
                                  .Arg<ffi::AnyBuffer>()  // down.scale
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, D]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // stats [2 * kStatsLen]: int64 as lo, hi words
                                  .Attr<int64_t>("weight_format")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("schedule")
                                  .Attr<int64_t>("numa_nodes")
                                  .Attr<int64_t>("max_isa")
                                  .Attr<int64_t>("num_threads")
                                  .Attr<int64_t>("gate_up_slice")
                                  .Attr<int64_t>("down_slice"));

HMOE_FFI_TARGET("hmoe_moe_experts", MoeExperts);

}  // namespace hmoe
