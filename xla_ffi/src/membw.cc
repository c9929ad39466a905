// Memory read-bandwidth probe, run through the same FFI path and thread pool as the GEMM
// kernels so that the two are comparable (the decode GEMV's physical limit):
//   hmoe_read_bytes(buf any dtype) -> u32 [2] (low, high) = the sum of its 64-bit words (so the reads
//   cannot be optimised away); attrs max_isa (>= 2: 512-bit loads), num_threads.
// The caller times it; bytes / time = read bandwidth.
#include <algorithm>
#include <atomic>
#include <string>

#include "gemm_kernels.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hmoe {
namespace {

ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
}

ffi::Error ReadBytesImpl(ffi::AnyBuffer buf, ffi::Result<ffi::AnyBuffer> out, int64_t max_isa,
                         int64_t num_threads) {
  // uint32 [2] (low, high words), not uint64: JAX without x64 has no uint64 results.
  if (out->element_type() != ffi::DataType::U32 || out->element_count() != 2)
    return invalid("hmoe_read_bytes: result must be uint32 [2]");
  const auto* p = static_cast<const uint8_t*>(buf.untyped_data());
  const int64_t nbytes = static_cast<int64_t>(buf.size_bytes());
  const bool wide =
      select_isa(max_isa < 0 ? -1 : static_cast<int>(std::min<int64_t>(max_isa, 2))) == Isa::kAvx512;
  constexpr int64_t kChunk = 1 << 22;  // 4 MiB per task
  const int threads = num_threads <= 0 ? hardware_threads() : static_cast<int>(num_threads);
  std::atomic<uint64_t> total{0};
  parallel_for((nbytes + kChunk - 1) / kChunk, threads, [&](int64_t t) {
    const int64_t off = t * kChunk, len = std::min(kChunk, nbytes - off);
    total.fetch_add(wide ? read_sum_avx512(p + off, len) : read_sum_portable(p + off, len),
                    std::memory_order_relaxed);
  });
  const uint64_t sum = total.load();
  auto* o = static_cast<uint32_t*>(out->untyped_data());
  o[0] = static_cast<uint32_t>(sum);
  o[1] = static_cast<uint32_t>(sum >> 32);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HmoeReadBytes, ReadBytesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("max_isa")
                                  .Attr<int64_t>("num_threads"));

HMOE_FFI_TARGET("hmoe_read_bytes", HmoeReadBytes);

}  // namespace hmoe
