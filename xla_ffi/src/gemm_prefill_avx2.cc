// AVX2 prefill GEMM for FP8 and INT4 weights (M >= kAvx2GemmMinRows activation rows).
//
// The row tiles of gemm_avx2.cc are dot products: every 16 FP8 codes are decoded (12 uops)
// for at most 4 activation rows, so at prefill sizes the decode, not the FMAs, sets the
// pace (FP8 M = 256: 27 GFLOP/s on one Zen 3 core). Here each weight is decoded once per
// call into an f32 panel of 6 rows x one scale block, and the FMAs run in a register-blocked
// outer product: 6 weight rows (broadcast) x 16 activation rows (two vectors) = 12
// accumulators, 12 FMAs per 2 loads + 6 broadcasts (FP8 M = 256: 75-85 GFLOP/s). Vectors run
// over activation rows, so x is transposed once per call into 16-row groups (8 x 8 vector
// transposes) and the weights keep their natural [n][k] order. Within a scale block (FP8's
// 128 codes, INT4's group) the sums stay in f32 and the block's scale is applied once after
// it, into y^T: the numerics contract of every path (gemm_kernels.h).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "gemm_avx2_inl.h"
#include "gemm_kernels.h"
#include "isa_scratch.h"

namespace hmoe {
namespace {

constexpr int64_t kNr = 6, kMv = 16, kMaxM = 256;

// y^T[j][0..16) += s[j] * sum_k wp[j][k] * xT[k][0..16), j < NR; xT rows are 16 floats.
template <int NR>
inline void micro(const float* xT, const float* wp, int64_t kc, const float* s, float* yT,
                  int64_t ldyT) {
  __m256 acc[NR][2];
  for (int j = 0; j < NR; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 a0 = _mm256_load_ps(xT + k * kMv), a1 = _mm256_load_ps(xT + k * kMv + 8);
    for (int j = 0; j < NR; ++j) {
      const __m256 b = _mm256_broadcast_ss(wp + j * kc + k);
      acc[j][0] = _mm256_fmadd_ps(b, a0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(b, a1, acc[j][1]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const __m256 sj = _mm256_set1_ps(s[j]);
    float* out = yT + j * ldyT;
    _mm256_store_ps(out, _mm256_fmadd_ps(acc[j][0], sj, _mm256_load_ps(out)));
    _mm256_store_ps(out + 8, _mm256_fmadd_ps(acc[j][1], sj, _mm256_load_ps(out + 8)));
  }
}

// x^T of 8 packed bf16 rows (nullptr: a zero row) x columns [c, c + 8): dst[j * 16 + r] =
// x[r][c + j] as f32, by the usual 8 x 8 unpack / shuffle / permute transpose (~1 uop per
// element against ~3 for a scalar loop, which cost 10-20% of a 128-row MoE task).
inline void transpose8_bf16(const uint16_t* const (&rows)[8], int64_t c, float* dst) {
  __m256 v[8];
  for (int r = 0; r < 8; ++r) v[r] = rows[r] ? bf16x8(rows[r] + c) : _mm256_setzero_ps();
  __m256 t[8], u[8];
  for (int p = 0; p < 4; ++p) {
    t[2 * p] = _mm256_unpacklo_ps(v[2 * p], v[2 * p + 1]);
    t[2 * p + 1] = _mm256_unpackhi_ps(v[2 * p], v[2 * p + 1]);
  }
  for (int q = 0; q < 2; ++q) {  // rows 4q..4q+3: columns (0|4), (1|5), (2|6), (3|7)
    u[4 * q + 0] = _mm256_shuffle_ps(t[4 * q], t[4 * q + 2], 0x44);
    u[4 * q + 1] = _mm256_shuffle_ps(t[4 * q], t[4 * q + 2], 0xEE);
    u[4 * q + 2] = _mm256_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0x44);
    u[4 * q + 3] = _mm256_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_store_ps(dst + j * kMv, _mm256_permute2f128_ps(u[j], u[4 + j], 0x20));
    _mm256_store_ps(dst + (j + 4) * kMv, _mm256_permute2f128_ps(u[j], u[4 + j], 0x31));
  }
}

// What differs between the formats: the scale block along k, its decode into f32 and its
// scale. FP8 decodes to value * 2^-8 (gemm_avx2_inl.h) and folds 2^8 into the scale.
struct Fp8 {
  using Matrix = Fp8Matrix;
  static int64_t block(const Matrix& w) { return w.block_k; }
  static float scale(const Matrix& w, int64_t row, int64_t kb) {
    const int64_t nkb = (w.k + w.block_k - 1) / w.block_k;
    return w.scale[(row / w.block_n) * nkb + kb] * 256.0f;
  }
  // row's codes [k0, k0 + kc) -> out[0..kc)
  static void decode(const Matrix& w, int64_t row, int64_t k0, int64_t kc, float* out) {
    const uint8_t* p = w.w + row * w.k + k0;
    int64_t c = 0;
    for (; c + 16 <= kc; c += 16) {
      const __m256i h = fp8_to_f16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c)));
      _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
      _mm256_storeu_ps(out + c + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
    if (c < kc) {  // partial: never read past the row (it may end the buffer)
      alignas(16) uint8_t tmp[16] = {0};
      std::memcpy(tmp, p + c, kc - c);
      alignas(32) float f[16];
      const __m256i h = fp8_to_f16(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
      _mm256_store_ps(f, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
      _mm256_store_ps(f + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
      std::memcpy(out + c, f, (kc - c) * sizeof(float));
    }
  }
};

struct Int4 {
  using Matrix = Int4Matrix;
  static int64_t block(const Matrix& w) { return w.group; }
  static float scale(const Matrix& w, int64_t row, int64_t g) {
    return scale_bf16(w.scale[row * (w.k / w.group) + g]);
  }
  // a group is whole 64-element chunks (check_int4): kc == group, k0 a multiple of 64
  static void decode(const Matrix& w, int64_t row, int64_t k0, int64_t kc, float* out) {
    const uint8_t* p = w.q + row * (w.k / 2) + k0 / 2;
    for (int64_t c = 0; c < kc; c += 64) {
      __m256 v[8];
      int4_chunk_f32(p + c / 2, v);
      for (int q = 0; q < 8; ++q) _mm256_storeu_ps(out + c + 8 * q, v[q]);
    }
  }
};

// Weight rows [r0, r0 + NR), block by block along k, against every 16-row group of x^T;
// writes y[i][r0 + j]. The rows stream in order (NR sequential streams the prefetchers
// follow) while x^T, read once per panel, comes from L2 / L3. (Looping k blocks outside
// chunks of rows instead made each panel's decode wait on 2 NR lines at a k-byte stride:
// M = 16 ran at half the M = 256 rate.)
template <class F, int NR>
void panel(const typename F::Matrix& w, int64_t r0, const float* xT, int64_t mc, int64_t mpad,
           float* wp, float* yT, float* y, int64_t ldy) {
  const int64_t bk = F::block(w), nkb = (w.k + bk - 1) / bk;
  std::memset(yT, 0, sizeof(float) * NR * mpad);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * bk, kc = std::min(w.k, k0 + bk) - k0;
    float s[NR];
    for (int j = 0; j < NR; ++j) {
      F::decode(w, r0 + j, k0, kc, wp + j * kc);
      s[j] = F::scale(w, r0 + j, kb);
    }
    const float* xTb = xT + kb * bk * mpad;
    for (int64_t mv = 0; mv < mpad; mv += kMv) micro<NR>(xTb + mv * bk, wp, kc, s, yT + mv, mpad);
  }
  for (int64_t i = 0; i < mc; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + r0 + j] = yT[j * mpad + i];
}

// M packed bf16 rows x weight rows [n0, n1): x^T per <= kMaxM rows, then panels of kNr
// weight rows over the whole k.
template <class F>
void prefill(const uint16_t* xp, int64_t m, const typename F::Matrix& w, int64_t n0, int64_t n1,
             float* y, int64_t ldy) {
  thread_local IsaScratch<float> xT_buf, yT_buf, wp_buf;  // not std::vector: see isa_scratch.h
  const int64_t ks = packed_x_stride(w.k);
  const int64_t bk = F::block(w), nkb = (w.k + bk - 1) / bk;
  float* wp = wp_buf.reserve(static_cast<size_t>(kNr * bk));
  for (int64_t m0 = 0; m0 < m; m0 += kMaxM) {
    const int64_t mc = std::min(kMaxM, m - m0);
    const int64_t mpad = (mc + kMv - 1) / kMv * kMv;
    // x^T in 16-row groups, block by block: xT[kb][i / 16][kk][i % 16], so that the micro
    // kernel reads one contiguous 64-byte line per k (a [kk][mpad] layout, one line at a
    // 1 KiB stride per k, ran at ~4/5 of this); padding rows zero (their y^T is not used)
    float* xT = xT_buf.reserve(static_cast<size_t>(nkb * bk * mpad));
    for (int64_t i0 = 0; i0 < mpad; i0 += 8) {
      const uint16_t* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = i0 + r < mc ? xp + (m0 + i0 + r) * ks : nullptr;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = kb * bk, kc = std::min(w.k, k0 + bk) - k0;
        float* dst = xT + kb * bk * mpad + (i0 / kMv) * bk * kMv + i0 % kMv;
        // up to kc rounded to 8: still inside x's zero-padded row and this block's space
        for (int64_t c = 0; c < kc; c += 8) transpose8_bf16(rows, k0 + c, dst + c * kMv);
      }
    }
    float* yT = yT_buf.reserve(static_cast<size_t>(kNr * mpad));
    float* ym = y + m0 * ldy;
    int64_t r = n0;
    for (; r + kNr <= n1; r += kNr) panel<F, kNr>(w, r, xT, mc, mpad, wp, yT, ym, ldy);
    switch (n1 - r) {  // the range's last rows
      case 5: panel<F, 5>(w, r, xT, mc, mpad, wp, yT, ym, ldy); break;
      case 4: panel<F, 4>(w, r, xT, mc, mpad, wp, yT, ym, ldy); break;
      case 3: panel<F, 3>(w, r, xT, mc, mpad, wp, yT, ym, ldy); break;
      case 2: panel<F, 2>(w, r, xT, mc, mpad, wp, yT, ym, ldy); break;
      case 1: panel<F, 1>(w, r, xT, mc, mpad, wp, yT, ym, ldy); break;
      default: break;
    }
  }
}

}  // namespace

void fp8_gemm_prefill_avx2(const uint16_t* xp, int64_t m, const Fp8Matrix& w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy) {
  prefill<Fp8>(xp, m, w, n0, n1, y, ldy);
}

void int4_gemm_prefill_avx2(const uint16_t* xp, int64_t m, const Int4Matrix& w, int64_t n0,
                            int64_t n1, float* y, int64_t ldy) {
  prefill<Int4>(xp, m, w, n0, n1, y, ldy);
}

}  // namespace hmoe
