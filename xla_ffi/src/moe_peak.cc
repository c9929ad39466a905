// FFI targets `hmoe_bf16_dot_peak` and `hmoe_fma_peak`: measured register-resident peaks of
// this machine (all threads of our pool). The bf16 one is the denominator of e02's prefill
// (M=512) utilisation; FLOPs per vdpbf16ps zmm: 16 f32 lanes x 2 bf16 products x (multiply
// + add) = 64. The f32 FMA one is the side-by-side compute probe on CPUs without
// AVX-512-BF16; FLOPs per vfmadd ymm: 8 lanes x 2 = 16.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "cpu_features.h"
#include "registry.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hmoe {

float bf16_dot_peak_avx512(int64_t iters);
float fma_peak_avx2(int64_t iters);

namespace {

// Runs `loop(iters)` once on each of `num_threads` pool threads (0: all) and writes
// [flop/s, checksum]; `flops_per_iter` counts one thread's loop body.
template <typename Loop>
ffi::Error RunPeak(const char* name, ffi::Result<ffi::Buffer<ffi::F32>>& out, int64_t iters,
                   int64_t num_threads, double flops_per_iter, Loop loop) {
  if (iters < 1) return ffi::Error::InvalidArgument(std::string(name) + ": iters must be >= 1");
  if (out->element_count() != 2)
    return ffi::Error::InvalidArgument(std::string(name) + ": out must be float32 [2]");
  ThreadPool& pool = ThreadPool::global();
  const int threads = num_threads > 0 ? std::min<int>(num_threads, pool.num_threads()) : pool.num_threads();
  // One slot per thread, claimed atomically: a thread that joins late still does its share
  // (each slot's work is fixed), so the FLOP count is exact.
  std::atomic<int> next{0};
  std::atomic<uint32_t> sink{0};
  const auto t0 = std::chrono::steady_clock::now();
  pool.run(threads, [&](int) {
    for (int slot; (slot = next.fetch_add(1)) < threads;) {
      const float v = loop(iters);
      sink.fetch_add(static_cast<uint32_t>(v != 0.0f));
    }
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double flops = static_cast<double>(threads) * iters * flops_per_iter;
  out->typed_data()[0] = static_cast<float>(flops / s);
  out->typed_data()[1] = static_cast<float>(sink.load());
  return ffi::Error::Success();
}

ffi::Error Bf16DotPeakImpl(ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t iters, int64_t num_threads) {
  if (!cpu_features().avx512)
    return ffi::Error::InvalidArgument("hmoe_bf16_dot_peak: needs AVX-512-BF16, which this CPU lacks");
  return RunPeak("hmoe_bf16_dot_peak", out, iters, num_threads, 12 * 64, bf16_dot_peak_avx512);
}

ffi::Error FmaPeakImpl(ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t iters, int64_t num_threads) {
  if (!cpu_features().avx2)
    return ffi::Error::InvalidArgument("hmoe_fma_peak: needs AVX2 + FMA, which this CPU lacks");
  return RunPeak("hmoe_fma_peak", out, iters, num_threads, 12 * 16, fma_peak_avx2);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Bf16DotPeak, Bf16DotPeakImpl,
                              ffi::Ffi::Bind()
                                  .Ret<ffi::Buffer<ffi::F32>>()  // [flop/s, checksum]
                                  .Attr<int64_t>("iters")
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FmaPeak, FmaPeakImpl,
                              ffi::Ffi::Bind()
                                  .Ret<ffi::Buffer<ffi::F32>>()  // [flop/s, checksum]
                                  .Attr<int64_t>("iters")
                                  .Attr<int64_t>("num_threads"));

HMOE_FFI_TARGET("hmoe_bf16_dot_peak", Bf16DotPeak);
HMOE_FFI_TARGET("hmoe_fma_peak", FmaPeak);

}  // namespace hmoe
