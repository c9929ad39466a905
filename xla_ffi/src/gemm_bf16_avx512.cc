// AVX-512 BF16 GEMV/GEMM kernels: bf16 weights fed straight to vdpbf16ps (no decode, no
// scales). Split from gemm_avx512.cc (FP8/INT4 kernels and activation packing); shares its
// helpers through gemm_avx512_inl.h. Compiled with the AVX-512 flags (the *_avx512.cc
// rule in CMakeLists.txt); everything but the entry point is in an anonymous namespace.
#include <immintrin.h>

#include <algorithm>

#include "gemm_kernels.h"
#include "gemm_avx512_inl.h"

namespace hmoe {
namespace {

// ---- BF16 (no decode, no scales) ----
// One 64-byte line is 32 bf16 weights in natural order, fed straight to vdpbf16ps against
// x packed in natural order (WeightFormat::kBf16). A step covers 64 elements (two lines)
// per row; the whole row is one f32 sum; a partial last step (k % 64 != 0) masks the
// weight loads (x is zero padded). Prefetch as fp8_tile: the rows prefetch_tiles ahead.
// Tiles are 4 output rows x MB <= 4 activation rows at every m (not gemm_rows' 2 x 4 for
// m > 2): with K = 7168 neither the tile's weights nor its x rows fit L1, so every pass
// streams both from L2, (R + MB) vectors per R * MB dps; 4 x 4 needs 1 byte of L2
// traffic per MAC against 1.5 for 2 x 4 (measured on one core, L2-resident weights,
// 2 x 4: ~50 GMAC/s at M = 4 and 8, the M = 8 GEMV then ran at 0.6 of the read probe
// from DRAM). S = 2 accumulator chains per output when R * MB <= 8 (vdpbf16ps latency),
// else one (16 independent chains already).
template <int R, int MB>
void bf16_tile(const uint16_t* xp, int64_t ks, const Bf16Matrix& w, int64_t r0, float* y,
               int64_t ldy, int64_t n_end) {
  constexpr int S = R * MB <= 8 ? 2 : 1;
  const uint16_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = w.w + (r0 + r) * w.k;
  const int64_t pf_row = std::min(r0 + R * prefetch_tiles(R * w.k * 2), n_end - 1);
  const uint16_t* pf = w.w + pf_row * w.k;
  __m512 acc[R][MB][S];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i)
      for (int h = 0; h < S; ++h) acc[r][i][h] = _mm512_setzero_ps();
  // one 32-element vector at column c of every row, masked to `mask`, into chain h
  const auto vec = [&](int64_t c, __mmask32 mask, bool full, int h) {
    __m512i xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm512_loadu_si512(xp + i * ks + c);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = full ? _mm512_loadu_si512(rows[r] + c)
                              : _mm512_maskz_loadu_epi16(mask, rows[r] + c);
      for (int i = 0; i < MB; ++i) acc[r][i][h] = dp(acc[r][i][h], wv, xv[i]);
    }
  };
  int64_t c = 0;
  for (; c + 64 <= w.k; c += 64) {
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + r * w.k + c), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(pf + r * w.k + c + 32), _MM_HINT_T1);
    }
    vec(c, ~0u, true, 0);
    vec(c + 32, ~0u, true, S - 1);
  }
  if (c < w.k) {  // never read past the row (it may end the buffer): masked loads
    const int64_t len = w.k - c;
    vec(c, len >= 32 ? ~0u : ((1u << len) - 1), false, 0);
    if (len > 32) vec(c + 32, (1u << (len - 32)) - 1, false, S - 1);
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) {
      const __m512 a = S == 2 ? _mm512_add_ps(acc[r][i][0], acc[r][i][S - 1]) : acc[r][i][0];
      y[i * ldy + r0 + r] = hsum(a);
    }
}

template <int R>
void bf16_rows_mb(const uint16_t* xp, int64_t ks, int64_t mb, const Bf16Matrix& w, int64_t r0,
                  float* y, int64_t ldy, int64_t n_end) {
  HMOE_TILE_MB(mb, bf16_tile, xp, ks, w, r0, y, ldy, n_end);
}

}  // namespace

void bf16_gemm_rows_avx512(const uint16_t* xp, int64_t m, const Bf16Matrix& w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy) {
  // 4-row tiles (see bf16_tile), activation chunks of 4 inside each tile; m = 3 alone
  // takes 2-row tiles (2 x 3 with two chains per output: measured from DRAM on one core,
  // 1 GiB sets, side by side, 2026-12-04: ~1.2x the 4 x 3 tile's GB/s, while 2-row tiles
  // lost 10-20% at m = 1, 2 and 25% at m = 4, 8).
  const int64_t ks = packed_x_stride(w.k);
  int64_t r = n0;
  if (m == 3)
    for (; r + 2 <= n1; r += 2) bf16_rows_mb<2>(xp, ks, 3, w, r, y, ldy, n1);
  for (; r + 4 <= n1; r += 4)
    for (int64_t i0 = 0; i0 < m; i0 += 4)
      bf16_rows_mb<4>(xp + i0 * ks, ks, std::min<int64_t>(4, m - i0), w, r, y + i0 * ldy, ldy, n1);
  for (; r < n1; ++r)
    for (int64_t i0 = 0; i0 < m; i0 += 4)
      bf16_rows_mb<1>(xp + i0 * ks, ks, std::min<int64_t>(4, m - i0), w, r, y + i0 * ldy, ldy, n1);
}

}  // namespace hmoe
