// The f32 FMA peak of one core, the side-by-side compute probe on CPUs without AVX-512-BF16
// (measure/probes.ReadProbe.tflops): chains of vfmadd on registers only (no memory traffic).
// Compiled with the AVX2 flags; only called after cpu_features() says AVX2 + FMA are there.
#include <immintrin.h>

#include <cstdint>

namespace hmoe {

// Runs `iters` x 12 independent 8-lane FMAs (12 chains hide the FMA latency on two pipes);
// returns a value depending on all of them so the loop is not optimised away.
float fma_peak_avx2(int64_t iters) {
  constexpr int kChains = 12;
  __m256 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm256_setzero_ps();
  const __m256 a = _mm256_set1_ps(1.0f);
  const __m256 b = _mm256_set1_ps(0x1p-20f);  // sums stay finite for any iters used
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < kChains; ++j) acc[j] = _mm256_fmadd_ps(a, b, acc[j]);
  }
  __m256 s = acc[0];
  for (int j = 1; j < kChains; ++j) s = _mm256_add_ps(s, acc[j]);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_hadd_ps(h, h);
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(h);
}

}  // namespace hmoe
