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
// INT4: nibbles -> int8 by vpshufb -> int32 -> f32, FMA (same tiles and x handling).
// From 16 activation rows both run the prefill GEMM of gemm_prefill_avx2.cc.
// Anonymous namespace throughout: this file has AVX2 flags (see gemm_avx512.cc).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "gemm_avx2_inl.h"
#include "gemm_kernels.h"
#include "isa_scratch.h"

namespace hmoe {
namespace {

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

// INT4: R weight rows x MB f32 activation rows, the whole k; one 64-element chunk's decode
// (~28 uops: and, shift, two vpshufb, eight sign extends and conversions) serves MB rows;
// S accumulators per (r, i) as in fp8_tile.
template <int R, int MB>
void int4_tile(const float* xf, int64_t ks, const Int4Matrix& w, int64_t r0, float* y,
               int64_t ldy, int64_t n_end) {
  constexpr int S = MB <= 2 ? 2 : 1;
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
    __m256 acc[R][MB][S];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < MB; ++i)
        for (int s = 0; s < S; ++s) acc[r][i][s] = _mm256_setzero_ps();
    for (int64_t c = g * w.group; c < (g + 1) * w.group; c += 64) {
      if ((c & 127) == 0)
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(pf + r * row_bytes + c / 2), _MM_HINT_T1);
      for (int r = 0; r < R; ++r) {
        __m256 wv[8];
        int4_chunk_f32(rows[r] + c / 2, wv);
        for (int q = 0; q < 8; ++q)
          for (int i = 0; i < MB; ++i) {
            const __m256 xv = _mm256_load_ps(xf + i * ks + c + 8 * q);
            acc[r][i][q % S] = _mm256_fmadd_ps(wv[q], xv, acc[r][i][q % S]);
          }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(scale_bf16(srow[r][g]));
      for (int i = 0; i < MB; ++i) {
        const __m256 a = S == 2 ? _mm256_add_ps(acc[r][i][0], acc[r][i][S - 1]) : acc[r][i][0];
        tot[r][i] = _mm256_fmadd_ps(a, s, tot[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) y[i * ldy + r0 + r] = hsum(tot[r][i]);
}

template <int R, int MB>
struct Fp8Tile {
  static void run(const float* xf, int64_t ks, const Fp8Matrix& w, int64_t r0, float* y,
                  int64_t ldy, int64_t n_end) {
    fp8_tile<R, MB>(xf, ks, w, r0, y, ldy, n_end);
  }
};
template <int R, int MB>
struct Int4Tile {
  static void run(const float* xf, int64_t ks, const Int4Matrix& w, int64_t r0, float* y,
                  int64_t ldy, int64_t n_end) {
    int4_tile<R, MB>(xf, ks, w, r0, y, ldy, n_end);
  }
};

// Weight rows [n0, n1) x one block of MB f32 activation rows: pairs of weight rows, then
// the odd one.
template <template <int, int> class Tile, class Matrix, int MB>
void rows_block(const float* xf, int64_t ks, const Matrix& w, int64_t n0, int64_t n1, float* y,
                int64_t ldy) {
  int64_t r = n0;
  for (; r + 2 <= n1; r += 2) Tile<2, MB>::run(xf, ks, w, r, y, ldy, n1);
  if (r < n1) Tile<1, MB>::run(xf, ks, w, r, y, ldy, n1);
}

template <template <int, int> class Tile, class Matrix>
void rows_any(const float* xf, int64_t ks, int64_t mb, const Matrix& w, int64_t n0, int64_t n1,
              float* y, int64_t ldy) {
  switch (mb) {
    case 1: return rows_block<Tile, Matrix, 1>(xf, ks, w, n0, n1, y, ldy);
    case 2: return rows_block<Tile, Matrix, 2>(xf, ks, w, n0, n1, y, ldy);
    case 3: return rows_block<Tile, Matrix, 3>(xf, ks, w, n0, n1, y, ldy);
    default: return rows_block<Tile, Matrix, 4>(xf, ks, w, n0, n1, y, ldy);
  }
}

// FP8 / INT4 rows below the prefill GEMM: x becomes f32 once per block of 4 activation
// rows (a thread's scratch), so the tiles read it with plain loads (converting bf16 x in
// the tile cost 3 uops per 8 values per weight-row pair). Up to 4 rows (decode) the weights
// stream once; beyond that the weight rows go in chunks sized to stay in L2 (~256 KiB)
// while every block of 4 activation rows passes over the chunk, instead of re-reading all
// weights per block.
template <template <int, int> class Tile, class Matrix>
void tiled_rows(const uint16_t* xp, int64_t m, const Matrix& w, int64_t row_bytes, int64_t n0,
                int64_t n1, float* y, int64_t ldy) {
  constexpr int64_t kMb = 4, kChunkBytes = 256 << 10;
  thread_local IsaScratch<float> scratch;  // not std::vector: see isa_scratch.h
  const int64_t ks = packed_x_stride(w.k);
  float* xf = scratch.reserve(static_cast<size_t>(kMb * ks));
  if (m <= kMb) {
    unpack_x(xp, ks, m, xf);
    rows_any<Tile>(xf, ks, m, w, n0, n1, y, ldy);
    return;
  }
  const int64_t chunk = std::max<int64_t>(8, kChunkBytes / std::max<int64_t>(1, row_bytes)) / 2 * 2;
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = std::min(n1, c0 + chunk);
    for (int64_t i0 = 0; i0 < m; i0 += kMb) {
      const int64_t mb = std::min(kMb, m - i0);
      unpack_x(xp + i0 * ks, ks, mb, xf);
      rows_any<Tile>(xf, ks, mb, w, c0, c1, y + i0 * ldy, ldy);
    }
  }
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

void fp8_gemm_rows_avx2(const uint16_t* xp, int64_t m, const Fp8Matrix& w, int64_t n0,
                        int64_t n1, float* y, int64_t ldy) {
  if (m >= kAvx2GemmMinRows) return fp8_gemm_prefill_avx2(xp, m, w, n0, n1, y, ldy);
  tiled_rows<Fp8Tile>(xp, m, w, w.k, n0, n1, y, ldy);
}

void int4_gemm_rows_avx2(const uint16_t* xp, int64_t m, const Int4Matrix& w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy) {
  if (m >= kAvx2GemmMinRows) return int4_gemm_prefill_avx2(xp, m, w, n0, n1, y, ldy);
  tiled_rows<Int4Tile>(xp, m, w, w.k / 2, n0, n1, y, ldy);
}

void bf16_gemm_rows_avx2(const uint16_t* xp, int64_t m, const Bf16Matrix& w, int64_t n0,
                         int64_t n1, float* y, int64_t ldy) {
  gemm_rows(xp, m, w, n0, n1, y, ldy, bf16_tile<1, 1>, bf16_tile<1, 2>, bf16_tile<2, 1>,
            bf16_tile<2, 2>);
}

}  // namespace hmoe
