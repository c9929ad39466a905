// Adapter from the MoE scheduler to the GEMV kernels of gemm_kernels.h.
#include "moe_gemv.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace hmoe {
namespace {

Fp8Matrix as_fp8(const ExpertMatrix& w) {
  Fp8Matrix f;
  f.w = w.q;
  f.scale = static_cast<const float*>(w.scale);
  f.n = w.n;
  f.k = w.k;
  return f;  // DeepSeek's 128 x 128 blocks
}

Int4Matrix as_int4(const ExpertMatrix& w) {
  Int4Matrix f;
  f.q = w.q;
  f.scale = static_cast<const uint16_t*>(w.scale);
  f.n = w.n;
  f.k = w.k;
  f.group = w.group_size;
  return f;
}

}  // namespace

int64_t expert_matrix_bytes(const ExpertMatrix& w) {
  if (w.format == WeightFormat::kFp8) return w.n * w.k + ((w.n + 127) / 128) * ((w.k + 127) / 128) * 4;
  return w.n * (w.k / 2) + w.n * (w.k / w.group_size) * 2;
}

std::string check_expert_matrix(const ExpertMatrix& w) {
  return w.format == WeightFormat::kFp8 ? check_fp8(as_fp8(w)) : check_int4(as_int4(w));
}

void expert_gemv(const ExpertMatrix& w, Isa isa, const uint16_t* xp, int64_t m, int64_t n0,
                 int64_t n1, float* y, int64_t ldy) {
  if (w.format == WeightFormat::kFp8) fp8_gemm_rows(isa, xp, m, as_fp8(w), n0, n1, y, ldy);
  else int4_gemm_rows(isa, xp, m, as_int4(w), n0, n1, y, ldy);
}

void silu_mul_pack(Isa isa, WeightFormat fmt, const float* g, const float* u, int64_t c0,
                   int64_t c1, int64_t k, uint16_t* hp) {
  // Scatter through the packed layout: walk the positions of the blocks that the layout
  // permutes within (packed_x_source: 64-chunks, 128-blocks for INT4) and that hold
  // [c0, c1), and fill those whose column is in [c0, c1). Positions past k (zero padding)
  // exist only in FP8's last 64-chunk, which the slice ending at k alone walks.
  const Isa resolved = gemm_isa(isa);
  const int64_t block = fmt == WeightFormat::kInt4 ? 128 : 64;
  const int64_t p0 = c0 / block * block;
  const int64_t p1 = std::min(packed_x_stride(k), (c1 + block - 1) / block * block);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t c = packed_x_source(resolved, fmt, k, p);
    if (c >= k) {
      hp[p] = 0;
    } else if (c >= c0 && c < c1) {
      const float gv = g[c - c0];
      hp[p] = f32_to_bf16_rne(gv / (1.0f + std::exp(-gv)) * u[c - c0]);
    }
  }
}

}  // namespace hmoe
