// Helpers shared by the AVX-512 kernel files (gemm_avx512.cc, gemm_bf16_avx512.cc).
// Include ONLY from translation units compiled with the AVX-512 flags (files named
// *_avx512.cc, see CMakeLists.txt). Everything here is in an anonymous namespace, so each
// TU gets its own internal copy: a shared inline template across TUs with different ISA
// flags would risk generic code calling AVX-512 code (the linker may keep either copy).
#ifndef HMOE_GEMM_AVX512_INL_H_
#define HMOE_GEMM_AVX512_INL_H_

#ifndef __AVX512BF16__
#error "gemm_avx512_inl.h is for translation units compiled with the AVX-512 flags"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace hmoe {
namespace {

inline __m512 dp(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(w), reinterpret_cast<__m512bh>(x));
}

// Horizontal sum (GCC 12's _mm512_reduce_add_ps trips -Wuninitialized in its header).
inline float hsum(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(v, 0), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Software prefetch: for each 64-byte line of this row tile, the line at the same offset
// `prefetch_tiles` tiles ahead, so that at least kPrefetchAheadBytes are in flight ahead of
// the loads. One tile ahead was too close for short rows: an INT4 q_b tile (4 rows of
// 768 B) is 3 KiB, ~0.1-0.2 us of work per core, below this VM's DRAM latency; measured
// side by side (2 threads, 2 GiB sets, 2026-12-03): INT4 [24576, 1536] 25 -> 30 GB/s, FP8
// +5-10% there; K = 2048 INT4 +0-10%; the K = 7168 tiles (>= 14 KiB) keep 1 tile.
constexpr int64_t kPrefetchAheadBytes = 8192;
inline int64_t prefetch_tiles(int64_t tile_bytes) {
  return std::max<int64_t>(1, (kPrefetchAheadBytes + tile_bytes - 1) / tile_bytes);
}

}  // namespace
}  // namespace hmoe

// In a function template over R (the tile's output rows) taking `int64_t mb`:
//   HMOE_TILE_MB(mb, fp8_tile, xp, ks, w, r0, y, ldy, n_end);
// returns tile<R, MB>(args...) for MB = min(mb, 4) in 1..4 (mb >= 1), the register tile's
// activation-row count as a template argument. A macro, not a template taking a lambda:
// it expands to the plain switch, so GCC's inlining of the tiles (and the kernels' code)
// stays what it was with the switch written out (a lambda version inlined differently).
#define HMOE_TILE_MB(mb, tile, ...)                  \
  switch (mb) {                                      \
    case 1: return tile<R, 1>(__VA_ARGS__);          \
    case 2: return tile<R, 2>(__VA_ARGS__);          \
    case 3: return tile<R, 3>(__VA_ARGS__);          \
    default: return tile<R, 4>(__VA_ARGS__);         \
  }

#endif  // HMOE_GEMM_AVX512_INL_H_
