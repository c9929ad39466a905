// AVX-512 (F/BW/VL/VBMI/BF16) FP8 and INT4 GEMV/GEMM kernels, the paper's technique 4.
//
// FP8: 64 e4m3 codes (one cache line) are expanded to 64 bf16 lanes in registers with two
// VBMI byte permutes (vpermi2b over 128-entry tables: the high and the low byte of the
// exact bf16 value of the code's magnitude), the sign bit OR'ed back, and the bytes
// interleaved into words; vdpbf16ps accumulates into f32; the block scale is applied
// once per 128-block (one FMA per accumulator). No f32/bf16 weight copy is ever stored.
// NaN codes (0x7F/0xFF) decode to a bf16 quiet NaN (sign kept), so a NaN weight makes
// its outputs NaN, as dequantize-then-dot does.
// INT4: 64 nibbles (32 bytes) -> zero-extended words -> bf16(136 + q) by one logic op
// per half (see below) -> vdpbf16ps into accumulators that start at -136 * sum(x);
// group scale once per group (one FMA).
//
// Tiling (M < 12; from 12 the blocked panel GEMM below): R output rows x MB activation
// rows per register tile (MB <= 4); larger M loops over activation chunks inside one row
// tile, so the tile's weights are re-read from L1, not DRAM. Software prefetch pulls a row
// tile >= 8 KiB ahead into L2 (_MM_HINT_T1) while this one runs: measured on one core
// (thread CPU time, 1 GiB sets), T1 gives FP8 0.9-1.0 of the read probe's bandwidth, T0
// (into L1) 0.6-0.7, none 0.65.
// Everything here is in an anonymous namespace: this file is compiled with AVX-512
// flags, and a shared inline template would risk generic code calling AVX-512 code.
// The BF16 kernels live in gemm_bf16_avx512.cc; helpers both use, in gemm_avx512_inl.h.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "bf16_bits_inl.h"
#include "gemm_avx512_inl.h"
#include "gemm_kernels.h"
#include "isa_scratch.h"

namespace hmoe {
namespace {

struct Fp8Tables {
  __m512i hi0, hi1, lo0, lo1;  // bf16 high/low bytes of |code|, codes 0-63 and 64-127
};

Fp8Tables make_fp8_tables() {
  alignas(64) uint8_t hi[128], lo[128];
  for (int c = 0; c < 128; ++c) {
    const uint16_t b = f32_to_bf16_rne(fp8_e4m3_to_f32(static_cast<uint8_t>(c)));
    hi[c] = static_cast<uint8_t>(b >> 8);
    lo[c] = static_cast<uint8_t>(b & 0xFF);
  }
  Fp8Tables t;
  t.hi0 = _mm512_load_si512(hi);
  t.hi1 = _mm512_load_si512(hi + 64);
  t.lo0 = _mm512_load_si512(lo);
  t.lo1 = _mm512_load_si512(lo + 64);
  return t;
}

const Fp8Tables& fp8_tables() {
  static const Fp8Tables t = make_fp8_tables();
  return t;
}

// 64 codes -> two bf16 vectors (A: chunk elements {0-7,16-23,32-39,48-55}, B: the rest;
// pack_x permutes x the same way).
inline void decode_fp8(__m512i codes, const Fp8Tables& t, __m512i sign, __m512i& a,
                       __m512i& b) {
  __m512i hi = _mm512_permutex2var_epi8(t.hi0, codes, t.hi1);  // index: low 7 bits
  hi = _mm512_ternarylogic_epi32(hi, codes, sign, 0xF8);      // hi | (codes & 0x80)
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, codes, t.lo1);
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

// R weight rows x MB activation rows (MB <= 4). Each 64-code line is decoded once and fed
// to MB x 2 dps. Software-pipelined: the next line (next row, or row 0 of the next chunk)
// is loaded and decoded BEFORE this line's dps in program order, and the chunks run as one
// flat loop with the block epilogue (scale the block's f32 sums into tot) when a block
// ends, so the decode never queues behind dps waiting on their accumulator chains.
// Measured against the per-block chunk loop (decode then dps), side by side on one core,
// bit-identical outputs: L2-resident weights M = 2-8 +5-15% (M = 1 equal), from DRAM
// M = 3-8 +5-20%. M >= 3 stays compute-bound at ~50 GMAC/s per core (~45% of the
// vdpbf16ps peak, 115 GMAC/s measured on this core): the per-128-block structure costs
// most of the rest (the same tile with block_k = K, a numerics change not made, ran
// 70-85 GMAC/s); 2 x 4 with two chains, 4 x 4, 2 x 8 / 1 x 8 activation-outer tiles,
// unrolled 128-blocks and parking block sums in memory all measured no better.
template <int R, int MB>
void fp8_tile(const uint16_t* xp, int64_t ks, const Fp8Matrix& w, int64_t r0, float* y,
              int64_t ldy, int64_t n_end) {
  // Two accumulator chains per (row, activation) when registers allow (R * MB <= 4):
  // vdpbf16ps has a ~6-cycle latency, and one chain per output would bound M = 1.
  constexpr int S = R * MB <= 4 ? 2 : 1;
  const Fp8Tables& t = fp8_tables();
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t nkb = (w.k + w.block_k - 1) / w.block_k;
  const uint8_t* rows[R];
  const float* srow[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = w.w + (r0 + r) * w.k;
    srow[r] = w.scale + ((r0 + r) / w.block_n) * nkb;
  }
  // The rows prefetch_tiles ahead (clamped to the slice) for prefetch.
  const int64_t pf_row = std::min(r0 + R * prefetch_tiles(R * w.k), n_end - 1);
  const uint8_t* pf = w.w + pf_row * w.k;
  // Load (the last partial chunk masked: block_k % 64 == 0, so only the row's end is) and
  // decode the 64-code line of row p at column c.
  const auto line = [&](const uint8_t* p, int64_t c, __m512i& a, __m512i& b) {
    const __m512i codes = c + 64 <= w.k ? _mm512_loadu_si512(p + c)
                                        : _mm512_maskz_loadu_epi8((1ull << (w.k - c)) - 1, p + c);
    decode_fp8(codes, t, sign, a, b);
  };
  __m512 tot[R][MB], acc[R][MB][S];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) {
      tot[r][i] = _mm512_setzero_ps();
      for (int h = 0; h < S; ++h) acc[r][i][h] = _mm512_setzero_ps();
    }
  __m512i na, nb;
  line(rows[0], 0, na, nb);
  int64_t kb = 0, block_end = std::min(w.k, w.block_k);
  for (int64_t c = 0; c < w.k; c += 64) {
    __m512i xa[MB], xb[MB];
    for (int i = 0; i < MB; ++i) {
      xa[i] = _mm512_loadu_si512(xp + i * ks + c);
      xb[i] = _mm512_loadu_si512(xp + i * ks + c + 32);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i wa = na, wb = nb;
      if (r + 1 < R) line(rows[r + 1], c, na, nb);
      else if (c + 64 < w.k) line(rows[0], c + 64, na, nb);
      _mm_prefetch(reinterpret_cast<const char*>(pf + r * w.k + c), _MM_HINT_T1);
      for (int i = 0; i < MB; ++i) {
        acc[r][i][0] = dp(acc[r][i][0], wa, xa[i]);
        acc[r][i][S - 1] = dp(acc[r][i][S - 1], wb, xb[i]);
      }
    }
    if (c + 64 >= block_end) {  // block kb done: scale its sums into tot
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(srow[r][kb]);
        for (int i = 0; i < MB; ++i) {
          const __m512 a = S == 2 ? _mm512_add_ps(acc[r][i][0], acc[r][i][S - 1]) : acc[r][i][0];
          tot[r][i] = _mm512_fmadd_ps(a, s, tot[r][i]);
          for (int h = 0; h < S; ++h) acc[r][i][h] = _mm512_setzero_ps();
        }
      }
      ++kb;
      block_end = std::min(w.k, block_end + w.block_k);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) y[i * ldy + r0 + r] = hsum(tot[r][i]);
}

template <int R>
void fp8_rows_mb(const uint16_t* xp, int64_t ks, int64_t mb, const Fp8Matrix& w, int64_t r0,
                 float* y, int64_t ldy, int64_t n_end) {
  HMOE_TILE_MB(mb, fp8_tile, xp, ks, w, r0, y, ldy, n_end);
}

// ---- FP8, larger M: a blocked GEMM over decoded weight panels. The activations are cut
// into blocks of kMc rows x kc columns (kc: the block fits kXBlockBytes, so it stays in L2
// while every weight panel of the thread's slice passes it, and a panel fits kPanelBytes,
// so it stays in L1); for each block, a panel of
// kPanelRows weight rows x kc columns is decoded once into an L1-resident bf16 buffer and
// run against the block's rows by 4 x 3 register tiles (12 independent accumulator chains
// cover vdpbf16ps's latency at two per cycle; 12 more hold the block-scaled sums). Partial
// sums of later column blocks are added into y. Chosen over re-decoding per activation
// chunk for m >= g_fp8_panel_min_m (re-decoding wins at m <= 8).
// Measured side by side on a Zen 5 VM, 2 threads, against the unblocked panel kernel it
// replaces (which streamed the whole [m, K] activations from L3 once per 4 weight rows):
// see docs/kernels.md "FP8 prefill GEMM".
int g_fp8_panel_min_m = 12;
constexpr int kPanelRows = 4;
constexpr int kTileRows = 3;
constexpr int64_t kMc = 192;                    // activation rows per block (a multiple of 3)
constexpr int64_t kXBlockBytes = 384 * 1024;    // activation block: [kMc, kc] bf16 in L2
constexpr int64_t kPanelBytes = 16 * 1024;      // weight panel: [kPanelRows, kc] bf16 in L1

// [hsum(a), hsum(b), hsum(c), hsum(d)]: pairwise adds within 128-bit lanes, then the four
// lanes folded.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // shuffle_ps, not unpack*_ps: GCC 12's unpack headers trip -Wmaybe-uninitialized
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(c, d, 0x44), _mm512_shuffle_ps(c, d, 0xEE));
  // per lane: ab = [a0+a2, a1+a3, b0+b2, b1+b3], cd likewise
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x88), _mm512_shuffle_ps(ab, cd, 0xDD));
  // per lane: [a, b, c, d] partial sums
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

template <int R, int MB>
void fp8_block_tile(const uint16_t* xp, int64_t ks, const uint16_t* panel, int64_t ps,
                    const Fp8Matrix& w, int64_t r0, int64_t c0, int64_t c1, float* y,
                    int64_t ldy, bool add) {
  // xp: the tile's first activation row (column 0); panel: row 0 of these R weight rows at
  // column c0 (row stride ps). Columns [c0, c1) are whole scale blocks (or end at ks).
  const int64_t nkb = (w.k + w.block_k - 1) / w.block_k;
  const float* srow[R];
  for (int r = 0; r < R; ++r) srow[r] = w.scale + ((r0 + r) / w.block_n) * nkb;
  __m512 tot[R][MB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) tot[r][i] = _mm512_setzero_ps();
  for (int64_t k0 = c0; k0 < c1; k0 += w.block_k) {
    const int64_t k1 = std::min(c1, k0 + w.block_k);
    __m512 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t c = k0; c < k1; c += 32) {
      __m512i xv[MB];
      for (int i = 0; i < MB; ++i) xv[i] = _mm512_loadu_si512(xp + i * ks + c);
      for (int r = 0; r < R; ++r) {
        const __m512i wv = _mm512_loadu_si512(panel + r * ps + (c - c0));
        for (int i = 0; i < MB; ++i) acc[r][i] = dp(acc[r][i], wv, xv[i]);
      }
    }
    const int64_t kb = k0 / w.block_k;
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(srow[r][kb]);
      for (int i = 0; i < MB; ++i) tot[r][i] = _mm512_fmadd_ps(acc[r][i], s, tot[r][i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    float* o = y + i * ldy + r0;
    if constexpr (R == 4) {  // the 4 rows' sums at once (~12 ops instead of 4 hsums' ~32)
      const __m128 v = hsum4(tot[0][i], tot[1][i], tot[2][i], tot[3][i]);
      _mm_storeu_ps(o, add ? _mm_add_ps(_mm_loadu_ps(o), v) : v);
    } else {
      for (int r = 0; r < R; ++r) o[r] = add ? o[r] + hsum(tot[r][i]) : hsum(tot[r][i]);
    }
  }
}

template <int R>
void fp8_block_rows(const uint16_t* xp, int64_t ks, int64_t mb, const uint16_t* panel,
                    int64_t ps, const Fp8Matrix& w, int64_t r0, int64_t c0, int64_t c1,
                    float* y, int64_t ldy, bool add) {
  switch (mb) {
    case 1: return fp8_block_tile<R, 1>(xp, ks, panel, ps, w, r0, c0, c1, y, ldy, add);
    case 2: return fp8_block_tile<R, 2>(xp, ks, panel, ps, w, r0, c0, c1, y, ldy, add);
    default: return fp8_block_tile<R, kTileRows>(xp, ks, panel, ps, w, r0, c0, c1, y, ldy, add);
  }
}

void fp8_panel_rows(const uint16_t* xp, int64_t m, const Fp8Matrix& w, int64_t n0, int64_t n1,
                    float* y, int64_t ldy) {
  const Fp8Tables& t = fp8_tables();
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t ks = packed_x_stride(w.k);
  // Column block: whole scale blocks (block_k % 64 == 0), sized so the row block's [rows,
  // kc] bf16 fits kXBlockBytes and a [kPanelRows, kc] panel kPanelBytes; the last ends at ks.
  thread_local IsaScratch<uint16_t> buf;  // not PackedX: see isa_scratch.h
  for (int64_t m0 = 0; m0 < m; m0 += kMc) {
    const int64_t m1 = std::min(m, m0 + kMc);
    const int64_t kc_bytes = std::min(kXBlockBytes / (m1 - m0), kPanelBytes / kPanelRows);
    const int64_t kc = std::max<int64_t>(w.block_k, kc_bytes / 2 / w.block_k * w.block_k);
    uint16_t* panel = buf.reserve(kPanelRows * kc);
    for (int64_t c0 = 0; c0 < ks; c0 += kc) {
      const int64_t c1 = std::min(ks, c0 + kc);
      for (int64_t r = n0; r < n1; r += kPanelRows) {
        const int64_t rr = std::min<int64_t>(kPanelRows, n1 - r);
        for (int64_t j = 0; j < rr; ++j) {  // decode the panel: [rr, c1 - c0] bf16, pack_x's order
          const uint8_t* row = w.w + (r + j) * w.k;
          const uint8_t* next = w.w + std::min(r + j + kPanelRows, n1 - 1) * w.k;
          for (int64_t c = c0; c < c1; c += 64) {
            const int64_t len = std::min<int64_t>(64, w.k - c);
            const __mmask64 mask = len >= 64 ? ~0ull : ((1ull << len) - 1);
            _mm_prefetch(reinterpret_cast<const char*>(next + std::min(c, w.k - 1)), _MM_HINT_T1);
            __m512i wa, wb;
            decode_fp8(_mm512_maskz_loadu_epi8(mask, row + c), t, sign, wa, wb);
            _mm512_storeu_si512(panel + j * kc + (c - c0), wa);
            _mm512_storeu_si512(panel + j * kc + (c - c0) + 32, wb);
          }
        }
        const bool add = c0 > 0;
        int64_t mb = 0;
        for (int64_t i0 = m0; i0 < m1; i0 += mb) {
          // 3 rows a tile; a remainder of 4 as 2 + 2 (a 1-row tile has 4 chains: latency-bound)
          const int64_t left = m1 - i0;
          mb = left == 4 ? 2 : std::min<int64_t>(kTileRows, left);
          const uint16_t* x0 = xp + i0 * ks;
          float* y0 = y + i0 * ldy;
          if (rr == kPanelRows) {
            fp8_block_rows<4>(x0, ks, mb, panel, kc, w, r, c0, c1, y0, ldy, add);
            continue;
          }
          int64_t j = 0;  // a tail panel of 1-3 rows: 2-row tiles, then a 1-row one
          for (; j + 2 <= rr; j += 2)
            fp8_block_rows<2>(x0, ks, mb, panel + j * kc, kc, w, r + j, c0, c1, y0, ldy, add);
          if (j < rr)
            fp8_block_rows<1>(x0, ks, mb, panel + j * kc, kc, w, r + j, c0, c1, y0, ldy, add);
        }
      }
    }
  }
}

// ---- INT4 ----
// Decode without a table: for a nibble v (two's complement q), (v ^ 8) = q + 8 in [0, 16),
// and bf16 bits 0x4300 | u are exactly 128 + u (the bf16 ulp at 128 is 1). So
// (v & 0xF) ^ 0x4308 is bf16(136 + q) in ONE ternary-logic op (no shuffle), and
//   sum_j x_j q_j = sum_j x_j (136 + q_j) - 136 * sum_j x_j,
// with sum_j x_j accumulated per lane by vdpbf16ps against bf16 ones, once per call
// (int4_block_sums), not per tile. Products stay exact; the f32 sums carry magnitudes ~136/|q|
// larger than the plain dot, a relative error ~2^-24 * 136 * sum|x| per group, far
// below the int4 step (tests bound it explicitly).
//
// Whole 128-element blocks (two 64-chunks = one 64-byte line per row) are decoded as 32
// words of 4 nibbles each: word i holds bytes 2i and 2i+1, i.e. (format of quant/int4.py)
// chunk elements 2i, 32+2i, 2i+1, 33+2i in nibbles 0-3 (words 16-31: the second chunk).
// (w >> 4t) & 0xF for t = 0..3 gives four bf16 vectors from one load with 3 shifts and 4
// logic ops, no zero-extension shuffle (pack_x permutes x to match: packed_x_source).
// Measured on one core with L2-resident weights (2026-12-03, side by side): 44-45 G
// weights/s at K = 7168 against 32 for decoding each 32-byte half through vpmovzxbw
// (K = 2048: 40 vs 31). At 2 threads from DRAM both run at ~0.7 of the read probe, so
// there it is memory-bound and the gain is within this machine's noise. Lanes 0-7
// of every accumulator then hold the first chunk's products and lanes 8-15 the second's,
// so a block needs one scale vector [s(chunk 0) x 8, s(chunk 1) x 8] (one vpshufb).
// A trailing 64-chunk (K % 128 == 64) keeps the natural order and the per-half decode.

// vpshufb control: every dword becomes bf16 word 0 (lanes 0-7) or word 1 (lanes 8-15) of
// the broadcast scale pair, shifted into the high half: the f32 value of that bf16.
__m512i make_scale_pair_control() {
  alignas(64) int8_t c[64];
  for (int d = 0; d < 16; ++d) {
    const int8_t b = d < 8 ? 0 : 2;
    c[4 * d] = c[4 * d + 1] = static_cast<int8_t>(0x80);
    c[4 * d + 2] = b;
    c[4 * d + 3] = static_cast<int8_t>(b + 1);
  }
  return _mm512_load_si512(c);
}

const __m512i& scale_pair_control() {  // built once, as fp8_tables()
  static const __m512i c = make_scale_pair_control();
  return c;
}

// Blocks of int4_block_sums per activation row: whole 128-blocks plus a trailing 64-chunk.
inline int64_t int4_sum_blocks(int64_t k) { return (k + 127) / 128; }

template <int R, int MB>
void int4_tile(const uint16_t* xp, int64_t ks, const float* xs, const Int4Matrix& w,
               int64_t r0, float* y, int64_t ldy, int64_t n_end) {
  // One accumulator chain per (row, activation), unlike fp8_tile: a block's four dps per
  // row start a fresh chain (acc = -136 sum x), so blocks overlap in the out-of-order
  // window anyway, and a second chain cost an add and a zeroing per row and block
  // (measured side by side, 2 threads from DRAM: +3-8% INT4 GB/s without it).
  const __m512i low4 = _mm512_set1_epi16(0xF);
  const __m512i bias = _mm512_set1_epi16(0x4308);
  const __m512i pair_ctl = scale_pair_control();
  const int64_t ng = w.k / w.group, row_bytes = w.k / 2;
  const int64_t nb = w.k / 128, nxs = int4_sum_blocks(w.k);
  const uint8_t* rows[R];
  const uint16_t* srow[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = w.q + (r0 + r) * row_bytes;
    srow[r] = w.scale + (r0 + r) * ng;
  }
  const int64_t pf_row = std::min(r0 + R * prefetch_tiles(R * row_bytes), n_end - 1);
  const uint8_t* pf = w.q + pf_row * row_bytes;
  // and that tile's group scales (a second stream, 1/16 of the bytes, which the hardware
  // prefetcher left to demand misses: measured side by side, 2 threads from DRAM, INT4
  // +14-26% at K = 2048, +17% at K = 1536, +0-6% at K = 7168)
  const char* pf_scale = reinterpret_cast<const char*>(w.scale + pf_row * ng);
  for (int64_t off = 0; off < R * ng * 2; off += 64) _mm_prefetch(pf_scale + off, _MM_HINT_T1);
  __m512 tot[R][MB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) tot[r][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // Accumulators start at -136 * sum(x) per lane (per call, int4_block_sums), so the
    // bias cancels inside the block and the epilogue is one FMA per block and row.
    __m512 acc[R][MB];
    for (int i = 0; i < MB; ++i) {
      const __m512 nx = _mm512_loadu_ps(xs + (i * nxs + b) * 16);
      for (int r = 0; r < R; ++r) acc[r][i] = nx;
    }
    __m512i xv[MB][4];
    for (int i = 0; i < MB; ++i)
      for (int t = 0; t < 4; ++t) xv[i][t] = _mm512_loadu_si512(xp + i * ks + 128 * b + 32 * t);
    const int64_t g0 = 128 * b / w.group, g1 = (128 * b + 64) / w.group;
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + r * row_bytes + 64 * b), _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(rows[r] + 64 * b);
      // (A & B) ^ C = ternlog 0x6A, with A = shifted words, B = 0xF, C = 0x4308
      const __m512i w0 = _mm512_ternarylogic_epi32(v, low4, bias, 0x6A);
      const __m512i w1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low4, bias, 0x6A);
      const __m512i w2 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), low4, bias, 0x6A);
      const __m512i w3 = _mm512_xor_si512(_mm512_srli_epi16(v, 12), bias);
      for (int i = 0; i < MB; ++i) {
        acc[r][i] = dp(acc[r][i], w0, xv[i][0]);
        acc[r][i] = dp(acc[r][i], w1, xv[i][1]);
        acc[r][i] = dp(acc[r][i], w2, xv[i][2]);
        acc[r][i] = dp(acc[r][i], w3, xv[i][3]);
      }
      uint32_t pair;  // group 64: the two scales are adjacent, one 32-bit load
      if (g1 == g0 + 1) std::memcpy(&pair, srow[r] + g0, 4);
      else pair = srow[r][g0] | (static_cast<uint32_t>(srow[r][g1]) << 16);
      const __m512 s =
          _mm512_castsi512_ps(_mm512_shuffle_epi8(_mm512_set1_epi32(static_cast<int>(pair)), pair_ctl));
      for (int i = 0; i < MB; ++i) tot[r][i] = _mm512_fmadd_ps(acc[r][i], s, tot[r][i]);
    }
  }
  if (nb < nxs) {  // trailing 64-chunk, natural order: low nibbles -> elements 0-31
    const int64_t c = 128 * nb;
    for (int r = 0; r < R; ++r) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + c / 2));
      const __m512i words = _mm512_cvtepu8_epi16(bytes);
      const __m512i wlo = _mm512_ternarylogic_epi32(words, low4, bias, 0x6A);
      const __m512i whi = _mm512_xor_si512(_mm512_srli_epi16(words, 4), bias);
      const __m512 s = _mm512_set1_ps(scale_bf16(srow[r][c / w.group]));
      for (int i = 0; i < MB; ++i) {
        __m512 a = _mm512_loadu_ps(xs + (i * nxs + nb) * 16);
        a = dp(a, wlo, _mm512_loadu_si512(xp + i * ks + c));
        a = dp(a, whi, _mm512_loadu_si512(xp + i * ks + c + 32));
        tot[r][i] = _mm512_fmadd_ps(a, s, tot[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) y[i * ldy + r0 + r] = hsum(tot[r][i]);
}

// Per-lane block sums of x (the 136 * sum(x) correction), computed once per call for all
// activation rows: xs[(i * nxs + b) * 16 + lane] = -136 * the sum of the packed x
// elements that lane of block b's accumulator multiplies (f32), nxs = blocks incl. a tail.
const float* int4_block_sums(const uint16_t* xp, int64_t m, const Int4Matrix& w) {
  thread_local IsaScratch<float> scratch;  // [m, nxs, 16]; not std::vector: see isa_scratch.h
  const int64_t nxs = int4_sum_blocks(w.k), ks = packed_x_stride(w.k);
  float* xs = scratch.reserve(m * nxs * 16);
  const __m512i ones = _mm512_set1_epi16(0x3F80);  // bf16 1.0
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < nxs; ++b) {
      __m512 a = _mm512_setzero_ps();
      const int64_t c1 = std::min<int64_t>(w.k, 128 * (b + 1));
      for (int64_t c = 128 * b; c < c1; c += 32) a = dp(a, _mm512_loadu_si512(xp + i * ks + c), ones);
      _mm512_storeu_ps(xs + (i * nxs + b) * 16, _mm512_mul_ps(a, _mm512_set1_ps(-136.0f)));
    }
  return xs;
}

template <int R>
void int4_rows_mb(const uint16_t* xp, int64_t ks, const float* xs, int64_t mb,
                  const Int4Matrix& w, int64_t r0, float* y, int64_t ldy, int64_t n_end) {
  HMOE_TILE_MB(mb, int4_tile, xp, ks, xs, w, r0, y, ldy, n_end);
}

// Row tiles of R (R = 4 when m <= 2: more independent streams; else 2 to keep R * MB * 2
// accumulators in 32 registers), activation chunks of 4 inside each tile.
template <typename Matrix, typename Rows4, typename Rows2, typename Rows1>
void gemm_rows(const uint16_t* xp, int64_t m, const Matrix& w, int64_t n0, int64_t n1,
               float* y, int64_t ldy, Rows4 rows4, Rows2 rows2, Rows1 rows1) {
  const int64_t ks = packed_x_stride(w.k);
  const int R = m <= 2 ? 4 : 2;
  int64_t r = n0;
  for (; r + R <= n1; r += R)
    for (int64_t i0 = 0; i0 < m; i0 += 4) {
      const int64_t mb = std::min<int64_t>(4, m - i0);
      if (R == 4)
        rows4(xp + i0 * ks, ks, mb, w, r, y + i0 * ldy, ldy, n1);
      else
        rows2(xp + i0 * ks, ks, mb, w, r, y + i0 * ldy, ldy, n1);
    }
  for (; r < n1; ++r)
    for (int64_t i0 = 0; i0 < m; i0 += 4)
      rows1(xp + i0 * ks, ks, std::min<int64_t>(4, m - i0), w, r, y + i0 * ldy, ldy, n1);
}

// ---- activation packing (pack_x_f32/bf16 for the AVX-512 layouts) ----
// The scalar loop of gemm_portable.cc costs ~3.5 ns per element (25 us for one K = 7168
// row, measured inside the FFI handler: 7% of a 2048x7168 FP8 GEMV), serial on the
// caller while the pool waits. Here: 16 f32 -> bf16 per vector op, the layout's
// permutation by vpermt2w. Bit-identical to the scalar path (f32_to_bf16_rne: round to
// nearest even, NaN quieted with its sign and payload top kept, subnormals kept, not
// flushed as vcvtneps2bf16 would).

inline __m256i bf16_rne16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

// 32 consecutive bf16 of row x (f32 or bf16 bits) from column c; columns >= k are zero.
inline __m512i load_bf16x32(const float* xf, const uint16_t* xb, int64_t c, int64_t k) {
  const int64_t len = std::max<int64_t>(0, std::min<int64_t>(32, k - c));
  if (xb) return _mm512_maskz_loadu_epi16(len == 32 ? ~0u : ((1u << len) - 1), xb + c);
  const __mmask16 m0 = len >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
  const __mmask16 m1 =
      len >= 32 ? 0xFFFF : len <= 16 ? 0 : static_cast<__mmask16>((1u << (len - 16)) - 1);
  const __m256i lo = bf16_rne16(_mm512_maskz_loadu_ps(m0, xf + c));
  const __m256i hi = bf16_rne16(_mm512_maskz_loadu_ps(m1, xf + c + 16));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

struct PackIdx {
  __m512i fp8_a, fp8_b, int4_even, int4_odd;
};

PackIdx make_pack_idx() {
  // vpermt2w indices into (table a = words 0-31, table b = words 32-63), taken from
  // packed_x_source (gemm_portable.cc), the one definition of the layouts; tests check both
  // layouts position by position (identity FP8 weight, identity x on INT4).
  alignas(64) uint16_t a[32], b[32], e[32], o[32];
  // INT4 vectors t = 0 (even elements) and t = 2 (odd) of a 128-block draw on elements 0-31
  // and 64-95, i.e. on (z0, z2); t = 1 and 3 take the same indices on (z1, z3).
  const auto int4_idx = [](int64_t el) { return static_cast<uint16_t>(el < 64 ? el : el - 32); };
  for (int i = 0; i < 32; ++i) {
    a[i] = static_cast<uint16_t>(packed_x_source(Isa::kAvx512, WeightFormat::kFp8, 64, i));
    b[i] = static_cast<uint16_t>(packed_x_source(Isa::kAvx512, WeightFormat::kFp8, 64, 32 + i));
    e[i] = int4_idx(packed_x_source(Isa::kAvx512, WeightFormat::kInt4, 128, i));
    o[i] = int4_idx(packed_x_source(Isa::kAvx512, WeightFormat::kInt4, 128, 64 + i));
  }
  return {_mm512_load_si512(a), _mm512_load_si512(b), _mm512_load_si512(e), _mm512_load_si512(o)};
}

const PackIdx& pack_idx() {
  static const PackIdx t = make_pack_idx();
  return t;
}

}  // namespace

void pack_x_avx512(WeightFormat fmt, const float* xf, const uint16_t* xb, int64_t m,
                   int64_t ldx, int64_t k, uint16_t* xp) {
  const PackIdx& t = pack_idx();
  const int64_t ks = packed_x_stride(k);
  for (int64_t i = 0; i < m; ++i) {
    const float* rf = xf ? xf + i * ldx : nullptr;
    const uint16_t* rb = xb ? xb + i * ldx : nullptr;
    uint16_t* out = xp + i * ks;
    int64_t c = 0;
    if (fmt == WeightFormat::kInt4) {
      // whole 128-blocks: vector t holds nibble t of every word (avx512_int4_source):
      // t = 0, 1 the even elements of the block's two chunks' first / second halves, t = 2, 3
      // the odd ones. A trailing 64-chunk stays in natural order (the loop below).
      for (; c + 128 <= k; c += 128) {
        const __m512i z0 = load_bf16x32(rf, rb, c, k), z1 = load_bf16x32(rf, rb, c + 32, k);
        const __m512i z2 = load_bf16x32(rf, rb, c + 64, k), z3 = load_bf16x32(rf, rb, c + 96, k);
        _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(z0, t.int4_even, z2));
        _mm512_storeu_si512(out + c + 32, _mm512_permutex2var_epi16(z1, t.int4_even, z3));
        _mm512_storeu_si512(out + c + 64, _mm512_permutex2var_epi16(z0, t.int4_odd, z2));
        _mm512_storeu_si512(out + c + 96, _mm512_permutex2var_epi16(z1, t.int4_odd, z3));
      }
      for (; c < ks; c += 32) _mm512_storeu_si512(out + c, load_bf16x32(rf, rb, c, k));
      continue;
    }
    if (fmt == WeightFormat::kBf16) {  // natural order
      for (; c < ks; c += 32) _mm512_storeu_si512(out + c, load_bf16x32(rf, rb, c, k));
      continue;
    }
    for (; c < ks; c += 64) {  // FP8: unpacklo/hi_epi8 order within each 64-chunk
      const __m512i z0 = load_bf16x32(rf, rb, c, k), z1 = load_bf16x32(rf, rb, c + 32, k);
      _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(z0, t.fp8_a, z1));
      _mm512_storeu_si512(out + c + 32, _mm512_permutex2var_epi16(z0, t.fp8_b, z1));
    }
  }
}

void fp8_gemm_rows_avx512(const uint16_t* xp, int64_t m, const Fp8Matrix& w, int64_t n0,
                          int64_t n1, float* y, int64_t ldy) {
  if (m >= g_fp8_panel_min_m) return fp8_panel_rows(xp, m, w, n0, n1, y, ldy);
  gemm_rows(xp, m, w, n0, n1, y, ldy, fp8_rows_mb<4>, fp8_rows_mb<2>, fp8_rows_mb<1>);
}

void int4_gemm_rows_avx512(const uint16_t* xp, int64_t m, const Int4Matrix& w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy) {
  // Same tiling as gemm_rows, plus the per-call group sums of x.
  const int64_t ks = packed_x_stride(w.k), nxs = int4_sum_blocks(w.k);
  const float* xs = int4_block_sums(xp, m, w);
  const int R = m <= 2 ? 4 : 2;
  int64_t r = n0;
  for (; r + R <= n1; r += R)
    for (int64_t i0 = 0; i0 < m; i0 += 4) {
      const int64_t mb = std::min<int64_t>(4, m - i0);
      const uint16_t* x0 = xp + i0 * ks;
      if (R == 4)
        int4_rows_mb<4>(x0, ks, xs + i0 * nxs * 16, mb, w, r, y + i0 * ldy, ldy, n1);
      else
        int4_rows_mb<2>(x0, ks, xs + i0 * nxs * 16, mb, w, r, y + i0 * ldy, ldy, n1);
    }
  for (; r < n1; ++r)
    for (int64_t i0 = 0; i0 < m; i0 += 4)
      int4_rows_mb<1>(xp + i0 * ks, ks, xs + i0 * nxs * 16, std::min<int64_t>(4, m - i0), w, r,
                      y + i0 * ldy, ldy, n1);
}

void set_fp8_panel_min_m(int m) { g_fp8_panel_min_m = m; }

uint64_t read_sum_avx512(const uint8_t* p, int64_t nbytes) {
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 256 <= nbytes; i += 256) {
    s0 = _mm512_add_epi64(s0, _mm512_loadu_si512(p + i));
    s1 = _mm512_add_epi64(s1, _mm512_loadu_si512(p + i + 64));
    s2 = _mm512_add_epi64(s2, _mm512_loadu_si512(p + i + 128));
    s3 = _mm512_add_epi64(s3, _mm512_loadu_si512(p + i + 192));
  }
  const __m512i s = _mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3));
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, s);
  uint64_t out = 0;
  for (uint64_t v : lanes) out += v;
  return out + read_sum_portable(p + i, nbytes - i);
}

}  // namespace hmoe
