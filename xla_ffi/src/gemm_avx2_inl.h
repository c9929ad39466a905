// Inline AVX2 helpers shared by the *_avx2.cc kernels (include only from such files: they
// are compiled with AVX2 flags, and the unnamed namespace gives each its own copy, see
// isa_scratch.h).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "bf16_bits_inl.h"

namespace {

// 16 FP8 e4m3 codes -> 16 f16 (as 16-bit lanes) = value * 2^-8, NaN codes -> f16 NaN.
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

// 32 bytes of a group-quantised INT4 row's 64-element chunk (low nibbles: elements 0..31,
// high: 32..63) -> 8 f32 vectors of its elements in natural order, exact.
inline void int4_chunk_f32(const uint8_t* p, __m256 (&out)[8]) {
  const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1,
                                       0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m256i low4 = _mm256_set1_epi8(0xF);
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(b, low4));
  const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(b, 4), low4));
  const __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                            _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
  for (int q = 0; q < 4; ++q) {
    out[2 * q] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[q]));
    out[2 * q + 1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(parts[q], 8)));
  }
}

}  // namespace
