// The MoE op's view of one expert matrix, adapted onto the GEMV kernels of gemm_kernels.h
// (one copy of the kernels, per ISA). The MoE scheduler needs: columns [n0, n1) of
// y = x . dequant(W)^T for the m gathered token rows of one expert, and the gate/up
// epilogue that writes bf16 silu(g) * u straight into the down projection's packed input.
#pragma once

#include <cstdint>

#include "cpu_features.h"
#include "gemm_kernels.h"

namespace hmoe {

// One [N, K] matrix of one expert, pointing into the layer's stacked arrays (never copied).
struct ExpertMatrix {
  WeightFormat format = WeightFormat::kFp8;
  const uint8_t* q = nullptr;  // FP8: e4m3 [N, K]; INT4: packed nibbles [N, K / 2]
  const void* scale = nullptr;  // FP8: f32 [ceil(N/128), ceil(K/128)]; INT4: bf16 [N, K/group]
  int64_t n = 0;
  int64_t k = 0;
  int64_t group_size = 0;  // INT4 only: scale group along K
};

// Bytes this matrix occupies (quantized values + scales): what a GEMV over it must read.
int64_t expert_matrix_bytes(const ExpertMatrix& w);

// Empty when the kernels accept the matrix, else a one-line message.
std::string check_expert_matrix(const ExpertMatrix& w);

// y[r * ldy + j] = sum_c x[r, c] * dequant(W)[j, c] for r < m, j in [n0, n1) (absolute
// column index j, as gemm_kernels.h). xp: m packed activation rows (pack_x_*, same isa
// and format), row stride packed_x_stride(w.k). Runs on the calling thread.
void expert_gemv(const ExpertMatrix& w, Isa isa, const uint16_t* xp, int64_t m, int64_t n0,
                 int64_t n1, float* y, int64_t ldy);

// Packed row [c0, c1) of the down projection's input (row length k): the positions of
// hp that hold columns c in [c0, c1) get pack(bf16(silu(g[c]) * u[c])). The packed layout
// permutes within 64-chunks (FP8) or 128-blocks (AVX-512 INT4) only, so slices with
// c0 % 64 == 0 (and c1 % 64 == 0 or c1 == k) write disjoint positions and together fill
// the row; zero padding past k is written by the slice that ends at k. hp points at the
// packed row's start. g, u: f32 values of columns [c0, c1).
void silu_mul_pack(Isa isa, WeightFormat fmt, const float* g, const float* u, int64_t c0,
                   int64_t c1, int64_t k, uint16_t* hp);

}  // namespace hmoe
