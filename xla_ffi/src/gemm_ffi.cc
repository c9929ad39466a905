// XLA FFI adapters for the GEMM kernels (gemm_kernels.h).
//
//   hmoe_fp8_gemm(x [..., K] f32|bf16, w [1.., N, K] f8e4m3fn|u8, scale [1.., ceil(N/bn),
//                 ceil(K/bk)] f32) -> y [..., N] f32;  attrs max_isa, num_threads,
//                 block_n, block_k
//   hmoe_int4_gemm(x [..., K] f32|bf16, q [1.., N, K/2] u8, scale [1.., N, K/group] bf16|u16)
//                 -> y [..., N] f32;  attrs max_isa, num_threads
//   hmoe_bf16_gemm(x [..., K] f32|bf16, w [1.., N, K] bf16|u16) -> y [..., N] f32;
//                 attrs max_isa, num_threads
//   hmoe_fp8_bmv(x [..., H, K] f32|bf16, w [1.., H, N, K] f8e4m3fn|u8, scale [1.., H,
//                 ceil(N/bn), ceil(K/bk)] f32) -> y [..., H, N] f32 (one FP8 GEMV per head);
//                 attrs max_isa, num_threads, block_n, block_k
// Leading dims of x are flattened into M; weights may carry leading size-1 dims (what
// vmap_method="expand_dims" adds). Every error names its operand.
#include <algorithm>
#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "gemm_kernels.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hmoe {
namespace {

template <typename Ints>
std::string list_str(const Ints& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

std::string dims_str(ffi::AnyBuffer b) { return list_str(b.dimensions()); }

std::string dtype_str(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    default: return "dtype#" + std::to_string(static_cast<int>(t));
  }
}

// max_isa attribute: -1 = best available, else 0 portable, 1 AVX2, 2 AVX-512.
Isa requested_isa(int64_t max_isa) {
  return select_isa(max_isa < 0 ? -1 : static_cast<int>(std::min<int64_t>(max_isa, 2)));
}

ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
}

// The last nd dims of an operand into out[0, nd) — nd = 2: one matrix, nd = 3: one head
// stack [H, ., .] — after checking the leading ones are 1.
ffi::Error trailing_dims(const char* op, const char* name, ffi::AnyBuffer b, size_t nd,
                         int64_t* out) {
  auto d = b.dimensions();
  const bool stack = nd == 3;
  if (d.size() < nd)
    return invalid(std::string(op) + ": " + name + " must have rank >= " + std::to_string(nd) +
                   (stack ? " ([H, ., .])" : "") + ", got shape " + dims_str(b));
  for (size_t i = 0; i + nd < d.size(); ++i)
    if (d[i] != 1)
      return invalid(std::string(op) + ": " + name + " leading dims must be 1 (" +
                     (stack ? "one head stack" : "one matrix") + " per call), got shape " +
                     dims_str(b));
  for (size_t i = 0; i < nd; ++i) out[i] = d[d.size() - nd + i];
  return ffi::Error::Success();
}

ffi::Error check_x_dtype(const char* op, ffi::AnyBuffer x) {
  const auto t = x.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16)
    return invalid(std::string(op) + ": x dtype must be float32 or bfloat16, got " +
                   dtype_str(t));
  return ffi::Error::Success();
}

ffi::Error check_result(const char* op, ffi::Result<ffi::AnyBuffer>& y, int64_t count,
                        const char* what) {
  if (y->element_count() != static_cast<size_t>(count) ||
      y->element_type() != ffi::DataType::F32)
    return invalid(std::string(op) + ": result must be float32 with " + what +
                   " elements, got shape " + dims_str(*y));
  return ffi::Error::Success();
}

// pack_x_f32 / pack_x_bf16 (by x's dtype) of m rows of x from element `offset` on.
void pack_rows(Isa isa, WeightFormat fmt, ffi::AnyBuffer x, int64_t offset, int64_t m,
               int64_t ldx, int64_t k, uint16_t* xp) {
  if (x.element_type() == ffi::DataType::F32)
    pack_x_f32(isa, fmt, static_cast<const float*>(x.untyped_data()) + offset, m, ldx, k, xp);
  else
    pack_x_bf16(isa, fmt, static_cast<const uint16_t*>(x.untyped_data()) + offset, m, ldx, k,
                xp);
}

struct Activations {
  int64_t m = 0, k = 0;
  PackedX packed;  // [m, packed_x_stride(k)], 64-byte aligned
};

ffi::Error pack_activations(const char* op, Isa isa, WeightFormat fmt, ffi::AnyBuffer x,
                            int64_t k_expected, Activations& out) {
  auto d = x.dimensions();
  if (d.size() < 1 || d[d.size() - 1] != k_expected)
    return invalid(std::string(op) + ": x shape " + dims_str(x) + " must end in K=" +
                   std::to_string(k_expected) + " (the weight's input dim)");
  if (auto e = check_x_dtype(op, x); e.failure()) return e;
  out.k = k_expected;
  out.m = 1;
  for (size_t i = 0; i + 1 < d.size(); ++i) out.m *= d[i];
  out.packed.resize(std::max<int64_t>(1, out.m * packed_x_stride(out.k)));
  pack_rows(isa, fmt, x, 0, out.m, out.k, out.k, out.packed.data());
  return ffi::Error::Success();
}

// The FP8 operands: w [1.., (H,) N, K] e4m3fn codes (or their uint8 bits) and scale
// [1.., (H,) ceil(N/bn), ceil(K/bk)] f32, with the H dim when `stacked` (h = its size,
// else 1). mat gets head 0's pointers and the blocks.
ffi::Error fp8_operands(const char* op, bool stacked, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                        int64_t block_n, int64_t block_k, Fp8Matrix& mat, int64_t& h) {
  if (w.element_type() != ffi::DataType::F8E4M3FN && w.element_type() != ffi::DataType::U8)
    return invalid(std::string(op) + ": w dtype must be float8_e4m3fn (or its uint8 bits), got " +
                   dtype_str(w.element_type()));
  if (scale.element_type() != ffi::DataType::F32)
    return invalid(std::string(op) + ": scale dtype must be float32, got " +
                   dtype_str(scale.element_type()));
  const size_t nd = stacked ? 3 : 2;
  int64_t wd[3], sd[3];
  if (auto e = trailing_dims(op, "w", w, nd, wd); e.failure()) return e;
  h = stacked ? wd[0] : 1;
  mat.n = wd[nd - 2];
  mat.k = wd[nd - 1];
  if (h <= 0)
    return invalid(std::string(op) + ": w must have H >= 1 heads, got shape " + dims_str(w));
  mat.block_n = block_n;
  mat.block_k = block_k;
  if (auto msg = check_fp8(mat); !msg.empty()) return invalid(std::string(op) + ": " + msg);
  if (auto e = trailing_dims(op, "scale", scale, nd, sd); e.failure()) return e;
  std::vector<int64_t> want = {(mat.n + block_n - 1) / block_n, (mat.k + block_k - 1) / block_k};
  if (stacked) want.insert(want.begin(), h);
  if (!std::equal(want.begin(), want.end(), sd))
    return invalid(std::string(op) + ": scale grid " + dims_str(scale) + " does not match w " +
                   dims_str(w) + " with blocks " + std::to_string(block_n) + "x" +
                   std::to_string(block_k) + ": expected " + list_str(want));
  mat.w = static_cast<const uint8_t*>(w.untyped_data());
  mat.scale = static_cast<const float*>(scale.untyped_data());
  return ffi::Error::Success();
}

// Guided row split: task i takes max(min_rows, remaining / (2 * threads)) rows, so tasks
// shrink from ~1/4 of the rows (threads = 2) to `min_rows` at the end. Why: with equal
// tasks (8 per thread before) the thread that finishes first idles for up to one task at
// the end of every call, ~17-31 us of 2 threads' time per 2048x7168 GEMV (measured inside
// the handler), while shrinking tasks end within one small task of each other; the
// early big tasks keep the hand-out count (~1 us each) low, and a core taken by a
// neighbour still sheds work to the other thread. min_rows: >= 16 rows and >= ~64 KiB of
// weights, a multiple of 4 (the kernels' row tile). Returns the task start rows + n.
std::vector<int64_t> guided_row_split(int64_t n, int threads, int64_t row_bytes) {
  const int64_t rows_64k = 65536 / std::max<int64_t>(1, row_bytes);
  const int64_t min_rows = std::max<int64_t>(16, (rows_64k + 3) / 4 * 4);
  std::vector<int64_t> starts;
  for (int64_t r = 0; r < n;) {
    starts.push_back(r);
    int64_t take = (n - r) / (2 * int64_t(std::max(1, threads)));
    take = std::max(min_rows, (take + 3) / 4 * 4);
    r = std::min(n, r + take);
  }
  starts.push_back(n);
  return starts;
}

template <typename RowsFn>
void run_rows(int64_t n, int64_t row_bytes, int64_t num_threads, RowsFn rows_fn) {
  const int threads = num_threads <= 0 ? hardware_threads() : static_cast<int>(num_threads);
  const std::vector<int64_t> starts = guided_row_split(n, threads, row_bytes);
  parallel_for(static_cast<int64_t>(starts.size()) - 1, threads,
               [&](int64_t t) { rows_fn(starts[t], starts[t + 1]); });
}

// What the one-matrix ops share once their weight is checked: pack x, check y [M, N],
// and run `rows` over run_rows' split of the N output rows (row_bytes: one weight row).
template <typename Matrix>
ffi::Error run_gemm(const char* op, WeightFormat fmt, const Matrix& mat, int64_t row_bytes,
                    GemmRowsFn<Matrix>* rows, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                    int64_t max_isa, int64_t num_threads) {
  const Isa isa = requested_isa(max_isa);
  Activations a;
  if (auto e = pack_activations(op, isa, fmt, x, mat.k, a); e.failure()) return e;
  if (auto e = check_result(op, y, a.m * mat.n, "M*N"); e.failure()) return e;
  float* out = static_cast<float*>(y->untyped_data());
  run_rows(mat.n, row_bytes, num_threads, [&](int64_t n0, int64_t n1) {
    rows(isa, a.packed.data(), a.m, mat, n0, n1, out, mat.n);
  });
  return ffi::Error::Success();
}

ffi::Error Fp8GemmImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                       ffi::Result<ffi::AnyBuffer> y, int64_t max_isa, int64_t num_threads,
                       int64_t block_n, int64_t block_k) {
  const char* op = "hmoe_fp8_gemm";
  Fp8Matrix mat;
  int64_t h = 0;
  if (auto e = fp8_operands(op, false, w, scale, block_n, block_k, mat, h); e.failure())
    return e;
  return run_gemm(op, WeightFormat::kFp8, mat, mat.k, fp8_gemm_rows, x, y, max_isa,
                  num_threads);
}

ffi::Error Int4GemmImpl(ffi::AnyBuffer x, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                        ffi::Result<ffi::AnyBuffer> y, int64_t max_isa, int64_t num_threads) {
  const char* op = "hmoe_int4_gemm";
  if (q.element_type() != ffi::DataType::U8)
    return invalid(std::string(op) + ": q dtype must be uint8 (two int4 per byte), got " +
                   dtype_str(q.element_type()));
  if (scale.element_type() != ffi::DataType::BF16 && scale.element_type() != ffi::DataType::U16)
    return invalid(std::string(op) + ": scale dtype must be bfloat16, got " +
                   dtype_str(scale.element_type()));
  int64_t qd[2], sd[2];  // [N, K/2], [N, K/group]
  if (auto e = trailing_dims(op, "q", q, 2, qd); e.failure()) return e;
  if (auto e = trailing_dims(op, "scale", scale, 2, sd); e.failure()) return e;
  Int4Matrix mat;
  mat.n = qd[0];
  mat.k = 2 * qd[1];
  if (sd[0] != mat.n || sd[1] <= 0 || mat.k % sd[1] != 0)
    return invalid(std::string(op) + ": scale shape " + dims_str(scale) + " does not match q " +
                   dims_str(q) + ": expected [" + std::to_string(mat.n) +
                   ", K/group] with K=" + std::to_string(mat.k));
  mat.group = mat.k / sd[1];
  if (auto msg = check_int4(mat); !msg.empty()) return invalid(std::string(op) + ": " + msg);
  mat.q = static_cast<const uint8_t*>(q.untyped_data());
  mat.scale = static_cast<const uint16_t*>(scale.untyped_data());
  return run_gemm(op, WeightFormat::kInt4, mat, mat.k / 2, int4_gemm_rows, x, y, max_isa,
                  num_threads);
}

ffi::Error Bf16GemmImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                        int64_t max_isa, int64_t num_threads) {
  const char* op = "hmoe_bf16_gemm";
  if (w.element_type() != ffi::DataType::BF16 && w.element_type() != ffi::DataType::U16)
    return invalid(std::string(op) + ": w dtype must be bfloat16 (or its uint16 bits), got " +
                   dtype_str(w.element_type()));
  int64_t wd[2];
  if (auto e = trailing_dims(op, "w", w, 2, wd); e.failure()) return e;
  Bf16Matrix mat;
  mat.n = wd[0];
  mat.k = wd[1];
  if (auto msg = check_bf16(mat); !msg.empty()) return invalid(std::string(op) + ": " + msg);
  mat.w = static_cast<const uint16_t*>(w.untyped_data());
  return run_gemm(op, WeightFormat::kBf16, mat, 2 * mat.k, bf16_gemm_rows, x, y, max_isa,
                  num_threads);
}

// y[b, h, :] = W[h] x[b, h, :] for H independent FP8 matrices W[h] [N, K]: each head is an
// Fp8Matrix view into the stack (pointer offsets) run by the FP8 kernel's fp8_gemm_rows,
// with x rows of stride H*K and y rows of stride H*N. Tasks split the H*N stacked rows
// (run_rows' guided split); a task crossing a head boundary makes one call per head.
ffi::Error Fp8BmvImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                      ffi::Result<ffi::AnyBuffer> y, int64_t max_isa, int64_t num_threads,
                      int64_t block_n, int64_t block_k) {
  const char* op = "hmoe_fp8_bmv";
  int64_t h = 0;
  Fp8Matrix head;
  if (auto e = fp8_operands(op, true, w, scale, block_n, block_k, head, h); e.failure())
    return e;
  auto xd = x.dimensions();
  if (xd.size() < 2 || xd[xd.size() - 1] != head.k || xd[xd.size() - 2] != h)
    return invalid(std::string(op) + ": x shape " + dims_str(x) + " must end in [H, K]=[" +
                   std::to_string(h) + ", " + std::to_string(head.k) +
                   "] (the weight's heads, input dim)");
  if (auto e = check_x_dtype(op, x); e.failure()) return e;
  int64_t b = 1;
  for (size_t i = 0; i + 2 < xd.size(); ++i) b *= xd[i];
  if (auto e = check_result(op, y, b * h * head.n, "B*H*N"); e.failure()) return e;
  const Isa isa = requested_isa(max_isa);
  // Packed x per head: xp[h] is [b, ks] (head h's rows of x, stride H*K in x).
  const int64_t ks = packed_x_stride(head.k);
  PackedX xp(std::max<int64_t>(1, h * b * ks));
  for (int64_t j = 0; j < h; ++j)
    pack_rows(isa, WeightFormat::kFp8, x, j * head.k, b, h * head.k, head.k,
              xp.data() + j * b * ks);
  const int64_t head_scales =
      ((head.n + block_n - 1) / block_n) * ((head.k + block_k - 1) / block_k);
  float* out = static_cast<float*>(y->untyped_data());
  run_rows(h * head.n, head.k, num_threads, [&](int64_t g0, int64_t g1) {
    for (int64_t j = g0 / head.n; j * head.n < g1; ++j) {
      Fp8Matrix mj = head;
      mj.w = head.w + j * head.n * head.k;
      mj.scale = head.scale + j * head_scales;
      const int64_t n0 = std::max(g0 - j * head.n, int64_t{0});
      const int64_t n1 = std::min(g1 - j * head.n, head.n);
      fp8_gemm_rows(isa, xp.data() + j * b * ks, b, mj, n0, n1, out + j * head.n, h * head.n);
    }
  });
  return ffi::Error::Success();
}

// The ops' FFI signatures: x and the weight's kOperands - 1 buffers, one result, the
// attrs max_isa and num_threads (gemm_binding), then block_n and block_k (fp8_binding).
// (Bindings are neither copied nor moved from outside the chain: pass temporaries on.)
template <int kOperands, typename B>
auto bind_operands(B&& b) {
  if constexpr (kOperands == 1)
    return std::move(b).template Arg<ffi::AnyBuffer>();
  else
    return bind_operands<kOperands - 1>(std::move(b).template Arg<ffi::AnyBuffer>());
}

template <int kOperands>
auto gemm_binding() {
  return bind_operands<kOperands>(ffi::Ffi::Bind())
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("max_isa")
      .template Attr<int64_t>("num_threads");
}

auto fp8_binding() {
  return gemm_binding<3>().Attr<int64_t>("block_n").Attr<int64_t>("block_k");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HmoeFp8Gemm, Fp8GemmImpl, fp8_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HmoeFp8Bmv, Fp8BmvImpl, fp8_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HmoeInt4Gemm, Int4GemmImpl, gemm_binding<3>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HmoeBf16Gemm, Bf16GemmImpl, gemm_binding<2>());
HMOE_FFI_TARGET("hmoe_fp8_gemm", HmoeFp8Gemm);
HMOE_FFI_TARGET("hmoe_int4_gemm", HmoeInt4Gemm);
HMOE_FFI_TARGET("hmoe_bf16_gemm", HmoeBf16Gemm);
HMOE_FFI_TARGET("hmoe_fp8_bmv", HmoeFp8Bmv);

}  // namespace hmoe
