// FFI target `hmoe_bf16_dot_peak`: measured bf16 dot-product peak FLOP/s of this machine
// (all threads of our pool), the denominator of e02's prefill (M=512) utilisation.
// FLOPs per vdpbf16ps zmm: 16 f32 lanes x 2 bf16 products x (multiply + add) = 64.
#include <atomic>
#include <chrono>
#include <cstdint>

#include "cpu_features.h"
#include "registry.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hmoe {

float bf16_dot_peak_avx512(int64_t iters);

namespace {

ffi::Error Bf16DotPeakImpl(ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t iters, int64_t num_threads) {
  if (!cpu_features().avx512)
    return ffi::Error::InvalidArgument("hmoe_bf16_dot_peak: needs AVX-512-BF16, which this CPU lacks");
  if (iters < 1) return ffi::Error::InvalidArgument("hmoe_bf16_dot_peak: iters must be >= 1");
  if (out->element_count() != 2)
    return ffi::Error::InvalidArgument("hmoe_bf16_dot_peak: out must be float32 [2]");
  ThreadPool& pool = ThreadPool::global();
  const int threads = num_threads > 0 ? std::min<int>(num_threads, pool.num_threads()) : pool.num_threads();
  // One slot per thread, claimed atomically: a thread that joins late still does its share
  // (each slot's work is fixed), so the FLOP count is exact.
  std::atomic<int> next{0};
  std::atomic<uint32_t> sink{0};
  const auto t0 = std::chrono::steady_clock::now();
  pool.run(threads, [&](int) {
    for (int slot; (slot = next.fetch_add(1)) < threads;) {
      const float v = bf16_dot_peak_avx512(iters);
      sink.fetch_add(static_cast<uint32_t>(v != 0.0f));
    }
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double flops = static_cast<double>(threads) * iters * 12 * 64;
  out->typed_data()[0] = static_cast<float>(flops / s);
  out->typed_data()[1] = static_cast<float>(sink.load());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Bf16DotPeak, Bf16DotPeakImpl,
                              ffi::Ffi::Bind()
                                  .Ret<ffi::Buffer<ffi::F32>>()  // [flop/s, checksum]
                                  .Attr<int64_t>("iters")
                                  .Attr<int64_t>("num_threads"));

HMOE_FFI_TARGET("hmoe_bf16_dot_peak", Bf16DotPeak);

}  // namespace hmoe
