// AVX2 + FMA + F16C FP8 and INT4 GEMV kernels (CPUs without AVX-512-BF16).
//
// FP8: an e4m3 code becomes an f16 with the same bits in the right place:
// f16 = (sign_extend(code) << 7) & 0xBF80 puts the sign at bit 15, the 4 exponent bits
// at the low end of f16's 5-bit exponent and the 3 mantissa bits on top of its 10-bit
// mantissa. As f16 that is the e4m3 value times 2^-8 for normals AND subnormals (f16's
// bias is 8 more than e4m3's), so vcvtph2ps gives exact f32 and the 2^8 is folded into
// the block scale. The NaN magnitude (0x7F) would read as 1.875, so it is patched to an
// f16 NaN first (flagging NaN codes on the raw bytes instead, 3 uops per 32 codes against
// the patch's 4 per 16, measured no faster on Zen 3: the decode is bound by its shuffle and
// convert uops, not by these ALU ones). x is unpacked to f32 once per call (per block of 4
// rows); products with bf16-rounded x are exact in f32; FMA accumulates.
// INT4: nibbles -> int8 by vpshufb -> int32 -> f32, FMA.
// Anonymous namespace throughout: this file has AVX2 flags (see gemm_avx512.cc).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "gemm_kernels.h"
#include "isa_scratch.h"

namespace hmoe {
namespace {

// bf16 bits -> f32, inline (a call into the portable TU per group costs ~40% at M = 1).
inline float scale_bf16(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// 16 codes -> 16 f16 (as 16-bit lanes) = value * 2^-8.
inline __m256i fp8_to_f16(__m128i codes) {
  __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7);
  h = _mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xBF80)));
  const __m256i mag = _mm256_and_si256(h, _mm256_set1_epi16(0x3F80));
  const __m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x3F80));
  return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)));
}

// 8 packed bf16 activations -> 8 f32.
inline __m256 bf16x8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One 16-code step of R weight rows x MB activation rows, x already in f32 (xf row i at
// xf + i * ks). S accumulators per (r, i): with MB <= 2 there are too few FMA chains to
// hide the FMA latency (4 cycles) behind the 2 FMA ports, so each 8-lane half gets its own.
template <int R, int MB, int S>
inline void fp8_step(const float* xf, int64_t ks, int64_t c, const __m128i (&codes)[R],
                     __m256 (&acc)[R][MB][S]) {
  for (int r = 0; r < R; ++r) {
    const __m256i h = fp8_to_f16(codes[r]);
    const __m256 w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    const __m256 w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    for (int i = 0; i < MB; ++i) {
      const float* xi = xf + i * ks + c;  // x is zero padded to a multiple of 64
      acc[r][i][0] = _mm256_fmadd_ps(w0, _mm256_load_ps(xi), acc[r][i][0]);
      acc[r][i][S - 1] = _mm256_fmadd_ps(w1, _mm256_load_ps(xi + 8), acc[r][i][S - 1]);
    }
  }
}

// R weight rows [r0, r0 + R) against MB f32 activation rows, the whole k. The e4m3 decode
// (12 uops per 16 codes) is shared by the MB rows, which is what makes batches and
// prefill cheaper per row than M = 1 (the old tiles took MB <= 2 and decoded every code
// once per pair of activation rows).
template <int R, int MB>
void fp8_tile(const float* xf, int64_t ks, const Fp8Matrix& w, int64_t r0, float* y, int64_t ldy,
              int64_t n_end) {
  constexpr int S = MB <= 2 ? 2 : 1;
  const int64_t nkb = (w.k + w.block_k - 1) / w.block_k;
  const uint8_t* rows[R];
  const float* srow[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = w.w + (r0 + r) * w.k;
    srow[r] = w.scale + ((r0 + r) / w.block_n) * nkb;
  }
  const uint8_t* pf = w.w + std::min(r0 + R, n_end - 1) * w.k;
  __m256 tot[R][MB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) tot[r][i] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * w.block_k, k1 = std::min(w.k, k0 + w.block_k);
    const int64_t kfull = k0 + (k1 - k0) / 16 * 16;
    __m256 acc[R][MB][S];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < MB; ++i)
        for (int s = 0; s < S; ++s) acc[r][i][s] = _mm256_setzero_ps();
    // whole 16-code chunks: no call in this loop. A memcpy inside it made the compiler keep
    // its constants and accumulators in stack memory (M = 1 at 5.6 GB/s on a Zen 3 core).
    for (int64_t c = k0; c < kfull; c += 16) {
      if ((c & 63) == 0)
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(pf + r * w.k + c), _MM_HINT_T1);
      __m128i codes[R];
      for (int r = 0; r < R; ++r)
        codes[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + c));
      fp8_step<R, MB, S>(xf, ks, c, codes, acc);
    }
    if (kfull < k1) {  // partial last chunk: never read past the row (it may end the buffer)
      __m128i codes[R];
      for (int r = 0; r < R; ++r) {
        alignas(16) uint8_t tmp[16] = {0};
        std::memcpy(tmp, rows[r] + kfull, k1 - kfull);
        codes[r] = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
      }
      fp8_step<R, MB, S>(xf, ks, kfull, codes, acc);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(srow[r][kb] * 256.0f);  // undo the f16 2^-8
      for (int i = 0; i < MB; ++i) {
        const __m256 a = S == 2 ? _mm256_add_ps(acc[r][i][0], acc[r][i][S - 1]) : acc[r][i][0];
        tot[r][i] = _mm256_fmadd_ps(a, s, tot[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) y[i * ldy + r0 + r] = hsum(tot[r][i]);
}

// MB (1..4) packed bf16 activation rows -> f32 rows of ks floats (exact: bf16 << 16).
void unpack_x(const uint16_t* xp, int64_t ks, int64_t mb, float* xf) {
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t c = 0; c < ks; c += 8) _mm256_store_ps(xf + i * ks + c, bf16x8(xp + i * ks + c));
}

// Weight rows [n0, n1) x one block of MB f32 activation rows: pairs of weight rows, then
// the odd one.
template <int MB>
void fp8_rows_block(const float* xf, int64_t ks, const Fp8Matrix& w, int64_t n0, int64_t n1,
                    float* y, int64_t ldy) {
  int64_t r = n0;
  for (; r + 2 <= n1; r += 2) fp8_tile<2, MB>(xf, ks, w, r, y, ldy, n1);
  if (r < n1) fp8_tile<1, MB>(xf, ks, w, r, y, ldy, n1);
}

void fp8_rows_any(const float* xf, int64_t ks, int64_t mb, const Fp8Matrix& w, int64_t n0,
                  int64_t n1, float* y, int64_t ldy) {
  switch (mb) {
    case 1: return fp8_rows_block<1>(xf, ks, w, n0, n1, y, ldy);
    case 2: return fp8_rows_block<2>(xf, ks, w, n0, n1, y, ldy);
    case 3: return fp8_rows_block<3>(xf, ks, w, n0, n1, y, ldy);
    default: return fp8_rows_block<4>(xf, ks, w, n0, n1, y, ldy);
  }
}

// ---- FP8 prefill GEMM (M >= kGemmMinRows) ----
// The tiles above are dot products: each 16 codes are decoded (12 uops) and used by at most
// 4 activation rows, so at M = 256 the decode, not the FMAs, sets the pace (0.07 TFLOPS on
// 2 Zen 3 cores against XLA's f32 dot at 0.13-0.15). Here every code is decoded once per
// call into an f32 panel and the FMAs run in a register-blocked outer product: 6 weight
// rows (broadcast) x 16 activation rows (two vectors) = 12 accumulators, 12 FMAs per 8
// loads. Vectors run over activation rows, so x is transposed per k block (x^T [kc][M],
// built once per call from the packed bf16, ~1% of the work) and the weights stay in their
// natural [n][k] order. Per 128-code block the sums stay in f32 and the block scale is
// applied once after it, into y^T held in L2 for a chunk of weight rows: the same numerics
// contract as every path (exact products, f32 sums per block, scale after the block).
// from 16 rows: at M = 8-12 the row tiles and this measured within noise of each other
constexpr int64_t kGemmMinRows = 16;
constexpr int64_t kGemmNr = 6, kGemmMv = 16, kGemmMaxM = 256;

// y^T[j][0..16) += s[j] * sum_k wp[j][k] * xT[k][0..16), j < NR.
template <int NR>
inline void fp8_gemm_micro(const float* xT, int64_t ldx, const float* wp, int64_t kc,
                           const float* s, float* yT, int64_t ldyT) {
  __m256 acc[NR][2];
  for (int j = 0; j < NR; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 a0 = _mm256_load_ps(xT + k * ldx), a1 = _mm256_load_ps(xT + k * ldx + 8);
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

// NR weight rows' codes [k0, k0 + kc) -> f32 (value * 2^-8) at wp[j][0..kc).
template <int NR>
void fp8_decode_panel(const Fp8Matrix& w, int64_t r0, int64_t k0, int64_t kc, float* wp) {
  for (int j = 0; j < NR; ++j) {
    const uint8_t* row = w.w + (r0 + j) * w.k + k0;
    float* out = wp + j * kc;
    int64_t c = 0;
    for (; c + 16 <= kc; c += 16) {
      const __m256i h = fp8_to_f16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
      _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
      _mm256_storeu_ps(out + c + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
    if (c < kc) {  // partial: never read past the row (it may end the buffer)
      alignas(16) uint8_t tmp[16] = {0};
      std::memcpy(tmp, row + c, kc - c);
      alignas(32) float f[16];
      const __m256i h = fp8_to_f16(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
      _mm256_store_ps(f, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
      _mm256_store_ps(f + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
      std::memcpy(out + c, f, (kc - c) * sizeof(float));
    }
  }
}

// x^T of 8 packed bf16 rows (nullptr: a zero row) x columns [c, c + 8): dst[j * 16 + r] =
// x[r][c + j] as f32, by the usual 8 x 8 unpack / shuffle / permute transpose (~1 uop per
// element against ~3 for a scalar loop).
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
    _mm256_store_ps(dst + j * kGemmMv, _mm256_permute2f128_ps(u[j], u[4 + j], 0x20));
    _mm256_store_ps(dst + (j + 4) * kGemmMv, _mm256_permute2f128_ps(u[j], u[4 + j], 0x31));
  }
}

// Weight rows [r0, r0 + NR), block by block along k, against every 16-row group of x^T;
// writes y[i][r0 + j]. The rows stream in order (NR sequential streams the prefetchers
// follow) while x^T, read once per panel, comes from L2 / L3. (Looping k blocks outside
// chunks of rows instead made each panel's decode wait on 2 NR lines at a k-byte stride:
// M = 16 ran at half the M = 256 rate.)
template <int NR>
void fp8_gemm_panel(const Fp8Matrix& w, int64_t r0, const float* xT, int64_t mc, int64_t mpad,
                    float* wp, float* yT, float* y, int64_t ldy) {
  const int64_t nkb = (w.k + w.block_k - 1) / w.block_k;
  std::memset(yT, 0, sizeof(float) * NR * mpad);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * w.block_k, kc = std::min(w.k, k0 + w.block_k) - k0;
    fp8_decode_panel<NR>(w, r0, k0, kc, wp);
    float s[NR];
    for (int j = 0; j < NR; ++j) s[j] = w.scale[((r0 + j) / w.block_n) * nkb + kb] * 256.0f;
    const float* xTb = xT + kb * w.block_k * mpad;
    for (int64_t mv = 0; mv < mpad; mv += kGemmMv)
      fp8_gemm_micro<NR>(xTb + mv * w.block_k, kGemmMv, wp, kc, s, yT + mv, mpad);
  }
  for (int64_t i = 0; i < mc; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + r0 + j] = yT[j * mpad + i];
}

// M (>= kGemmMinRows) packed bf16 rows x weight rows [n0, n1): x^T per <= kGemmMaxM rows,
// then panels of kGemmNr weight rows over the whole k.
void fp8_gemm_prefill(const uint16_t* xp, int64_t m, const Fp8Matrix& w, int64_t n0, int64_t n1,
                      float* y, int64_t ldy) {
  thread_local IsaScratch<float> xT_buf, yT_buf, wp_buf;  // not std::vector: see isa_scratch.h
  const int64_t ks = packed_x_stride(w.k);
  const int64_t nkb = (w.k + w.block_k - 1) / w.block_k;
  float* wp = wp_buf.reserve(static_cast<size_t>(kGemmNr * w.block_k));
  for (int64_t m0 = 0; m0 < m; m0 += kGemmMaxM) {
    const int64_t mc = std::min(kGemmMaxM, m - m0);
    const int64_t mpad = (mc + kGemmMv - 1) / kGemmMv * kGemmMv;
    // x^T in 16-row groups, k block by k block: xT[kb][i / 16][kk][i % 16], so that the
    // micro kernel reads one contiguous 64-byte line per k (a [kk][mpad] layout, one line
    // at a 1 KiB stride per k, ran at ~4/5 of this); padding rows zero (their y^T unused)
    float* xT = xT_buf.reserve(static_cast<size_t>(nkb * w.block_k * mpad));
    for (int64_t i0 = 0; i0 < mpad; i0 += 8) {
      const uint16_t* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = i0 + r < mc ? xp + (m0 + i0 + r) * ks : nullptr;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = kb * w.block_k, kc = std::min(w.k, k0 + w.block_k) - k0;
        float* dst = xT + kb * w.block_k * mpad + (i0 / kGemmMv) * w.block_k * kGemmMv + i0 % kGemmMv;
        // up to kc rounded to 8: still inside x's zero-padded row and this block's space
        for (int64_t c = 0; c < kc; c += 8) transpose8_bf16(rows, k0 + c, dst + c * kGemmMv);
      }
    }
    float* yT = yT_buf.reserve(static_cast<size_t>(kGemmNr * mpad));
    float* ym = y + m0 * ldy;
    int64_t r = n0;
    for (; r + kGemmNr <= n1; r += kGemmNr) fp8_gemm_panel<kGemmNr>(w, r, xT, mc, mpad, wp, yT, ym, ldy);
    switch (n1 - r) {  // the range's last rows
      case 5: fp8_gemm_panel<5>(w, r, xT, mc, mpad, wp, yT, ym, ldy); break;
      case 4: fp8_gemm_panel<4>(w, r, xT, mc, mpad, wp, yT, ym, ldy); break;
      case 3: fp8_gemm_panel<3>(w, r, xT, mc, mpad, wp, yT, ym, ldy); break;
      case 2: fp8_gemm_panel<2>(w, r, xT, mc, mpad, wp, yT, ym, ldy); break;
      case 1: fp8_gemm_panel<1>(w, r, xT, mc, mpad, wp, yT, ym, ldy); break;
      default: break;
    }
  }
}

template <int R, int MB>
void int4_tile(const uint16_t* xp, int64_t ks, const Int4Matrix& w, int64_t r0, float* y,
               int64_t ldy, int64_t n_end) {
  const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1,
                                       0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m256i low4 = _mm256_set1_epi8(0xF);
  const int64_t ng = w.k / w.group, row_bytes = w.k / 2;
  const uint8_t* rows[R];
  const uint16_t* srow[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = w.q + (r0 + r) * row_bytes;
    srow[r] = w.scale + (r0 + r) * ng;
  }
  const uint8_t* pf = w.q + std::min(r0 + R, n_end - 1) * row_bytes;
  __m256 tot[R][MB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) tot[r][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();
    for (int64_t c = g * w.group; c < (g + 1) * w.group; c += 64) {
      if ((c & 127) == 0)
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(pf + r * row_bytes + c / 2), _MM_HINT_T1);
      for (int r = 0; r < R; ++r) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + c / 2));
        // q8[0..31]: chunk elements 0..31 (low nibbles); q8[32..63]: 32..63 (high)
        const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(b, low4));
        const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(b, 4), low4));
        const __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                  _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
        for (int p = 0; p < 4; ++p) {
          const __m256 wa = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[p]));
          const __m256 wb = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(parts[p], 8)));
          for (int i = 0; i < MB; ++i) {
            const uint16_t* xr = xp + i * ks + c + 16 * p;
            acc[r][i] = _mm256_fmadd_ps(wa, bf16x8(xr), acc[r][i]);
            acc[r][i] = _mm256_fmadd_ps(wb, bf16x8(xr + 8), acc[r][i]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(scale_bf16(srow[r][g]));
      for (int i = 0; i < MB; ++i) tot[r][i] = _mm256_fmadd_ps(acc[r][i], s, tot[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) y[i * ldy + r0 + r] = hsum(tot[r][i]);
}

// BF16: 16 weights (32 bytes) -> two f32 vectors without a shuffle: v << 16 gives the
// even elements, v & 0xFFFF0000 the odd ones; x (natural order) is split the same way, so
// the lanes pair up; FMA into even / odd accumulators (two chains). Products are exact.
template <int R, int MB>
void bf16_tile(const uint16_t* xp, int64_t ks, const Bf16Matrix& w, int64_t r0, float* y,
               int64_t ldy, int64_t n_end) {
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint16_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = w.w + (r0 + r) * w.k;
  const uint16_t* pf = w.w + std::min(r0 + R, n_end - 1) * w.k;
  __m256 ae[R][MB], ao[R][MB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) ae[r][i] = ao[r][i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < w.k; c += 16) {
    if ((c & 31) == 0)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(pf + r * w.k + c), _MM_HINT_T1);
    __m256 xe[MB], xo[MB];
    for (int i = 0; i < MB; ++i) {  // x is zero padded to a multiple of 64
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + i * ks + c));
      xe[i] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      xo[i] = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
    }
    for (int r = 0; r < R; ++r) {
      __m256i v;
      if (c + 16 <= w.k) {
        v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + c));
      } else {  // partial last chunk: never read past the row (it may end the buffer)
        alignas(32) uint16_t tmp[16] = {0};
        std::memcpy(tmp, rows[r] + c, (w.k - c) * 2);
        v = _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
      }
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
      for (int i = 0; i < MB; ++i) {
        ae[r][i] = _mm256_fmadd_ps(we, xe[i], ae[r][i]);
        ao[r][i] = _mm256_fmadd_ps(wo, xo[i], ao[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) y[i * ldy + r0 + r] = hsum(_mm256_add_ps(ae[r][i], ao[r][i]));
}

// R = 2 output rows x MB <= 2 activation rows: 8 accumulators of the 16 ymm registers.
template <typename Matrix, typename Tile11, typename Tile12, typename Tile21, typename Tile22>
void gemm_rows(const uint16_t* xp, int64_t m, const Matrix& w, int64_t n0, int64_t n1,
               float* y, int64_t ldy, Tile11 t11, Tile12 t12, Tile21 t21, Tile22 t22) {
  const int64_t ks = packed_x_stride(w.k);
  int64_t r = n0;
  for (; r + 2 <= n1; r += 2)
    for (int64_t i0 = 0; i0 < m; i0 += 2) {
      if (m - i0 >= 2)
        t22(xp + i0 * ks, ks, w, r, y + i0 * ldy, ldy, n1);
      else
        t21(xp + i0 * ks, ks, w, r, y + i0 * ldy, ldy, n1);
    }
  for (; r < n1; ++r)
    for (int64_t i0 = 0; i0 < m; i0 += 2) {
      if (m - i0 >= 2)
        t12(xp + i0 * ks, ks, w, r, y + i0 * ldy, ldy, n1);
      else
        t11(xp + i0 * ks, ks, w, r, y + i0 * ldy, ldy, n1);
    }
}

}  // namespace

// FP8 rows: x becomes f32 once per block of 4 activation rows (a thread's scratch), so
// the tiles read it with plain loads (converting bf16 x in the tile cost 3 uops per 8
// values per weight-row pair). Up to 4 rows (decode) the weights stream once; beyond that
// (prefill) the weight rows go in chunks sized to stay in L2 (~256 KiB) while every block
// of 4 activation rows passes over the chunk, instead of re-reading all weights per block.
void fp8_gemm_rows_avx2(const uint16_t* xp, int64_t m, const Fp8Matrix& w, int64_t n0,
                        int64_t n1, float* y, int64_t ldy) {
  constexpr int64_t kMb = 4, kChunkBytes = 256 << 10;
  thread_local IsaScratch<float> scratch;  // not std::vector: see isa_scratch.h
  const int64_t ks = packed_x_stride(w.k);
  float* xf = scratch.reserve(static_cast<size_t>(kMb * ks));
  if (m >= kGemmMinRows) return fp8_gemm_prefill(xp, m, w, n0, n1, y, ldy);
  if (m <= kMb) {
    unpack_x(xp, ks, m, xf);
    fp8_rows_any(xf, ks, m, w, n0, n1, y, ldy);
    return;
  }
  const int64_t chunk = std::max<int64_t>(8, kChunkBytes / std::max<int64_t>(1, w.k)) / 2 * 2;
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = std::min(n1, c0 + chunk);
    for (int64_t i0 = 0; i0 < m; i0 += kMb) {
      const int64_t mb = std::min(kMb, m - i0);
      unpack_x(xp + i0 * ks, ks, mb, xf);
      fp8_rows_any(xf, ks, mb, w, c0, c1, y + i0 * ldy, ldy);
    }
  }
}

void int4_gemm_rows_avx2(const uint16_t* xp, int64_t m, const Int4Matrix& w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy) {
  gemm_rows(xp, m, w, n0, n1, y, ldy, int4_tile<1, 1>, int4_tile<1, 2>, int4_tile<2, 1>,
            int4_tile<2, 2>);
}

void bf16_gemm_rows_avx2(const uint16_t* xp, int64_t m, const Bf16Matrix& w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy) {
  gemm_rows(xp, m, w, n0, n1, y, ldy, bf16_tile<1, 1>, bf16_tile<1, 2>, bf16_tile<2, 1>,
            bf16_tile<2, 2>);
}

}  // namespace hmoe
