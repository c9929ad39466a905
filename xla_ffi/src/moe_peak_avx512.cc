// The bf16 dot-product peak of one core, for e02's "achieved vs peak TFLOPS": chains of
// vdpbf16ps on registers only (no memory traffic). Compiled with the AVX-512 flags; only
// called after cpu_features() says AVX-512-BF16 is there.
#include <immintrin.h>

#include <cstdint>

namespace hmoe {

// Runs `iters` x 12 independent vdpbf16ps (12 chains hide the instruction's latency);
// returns a value depending on all of them so the loop is not optimised away.
float bf16_dot_peak_avx512(int64_t iters) {
  constexpr int kChains = 12;
  __m512 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_setzero_ps();
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3800);  // bf16 2^-15: sums stay finite
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  }
  __m512 s = acc[0];
  for (int j = 1; j < kChains; ++j) s = _mm512_add_ps(s, acc[j]);
  return _mm512_reduce_add_ps(s);
}

}  // namespace hmoe
