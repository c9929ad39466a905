// Internal C++ API of the CPU FP8 / INT4 GEMV-GEMM kernels (no XLA types).
//
// y[m, n] = sum_k x[m, k] * dequant(W)[n, k], f32 out. Used by the FFI adapters in
// gemm_ffi.cc and by the fused MoE op, which does its own task split and calls the
// *_gemm_rows functions on its worker threads.
//
// Numerics, identical on every ISA path: activations are rounded to bf16 (round to
// nearest even) when packed; every weight decodes exactly (e4m3 and int4 values are exact
// in bf16 and f32), so each product x_bf16 * w is exact in f32; products are summed in
// f32 within one scale block / group, and the block scale is applied once per block
// after that accumulation. Only the summation order differs between paths.
//
// Usage (one expert, one output slice, on the calling thread):
//   std::vector<uint16_t> xp(m * packed_x_stride(k));
//   pack_x_f32(isa, WeightFormat::kFp8, x, m, /*ldx=*/k, k, xp.data());   // once per x
//   fp8_gemm_rows(isa, xp.data(), m, w, n0, n1, y, /*ldy=*/w.n);           // any slices
// The packed layout depends on (isa, format): pack and multiply with the same pair.
// Guarantee (the MoE op relies on it): any permutation acts within one 64-element chunk,
// so packing a row 64 elements at a time at 64-aligned offsets equals packing it whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "cpu_features.h"

namespace hmoe {

// DeepSeek block-FP8 weight [n, k], row-major (row stride k bytes), e4m3fn codes, and
// one f32 scale per block_n x block_k block, [ceil(n / block_n), ceil(k / block_k)],
// MULTIPLIED to dequantize (weight_scale_inv). Edge blocks may be partial in n and k.
// The SIMD paths need block_k % 64 == 0 (DeepSeek uses 128); check_fp8 enforces it.
struct Fp8Matrix {
  const uint8_t* w = nullptr;
  const float* scale = nullptr;
  int64_t n = 0;
  int64_t k = 0;
  int64_t block_n = 128;
  int64_t block_k = 128;
};

// Group-quantized symmetric INT4 weight [n, k]: w = q * scale, q a two's-complement
// int4 in [-8, 7] (our quantizer uses [-7, 7]), one bf16 scale per `group` consecutive
// elements along k: scale is [n, k / group] (bf16 bits). Packed two per byte, k / 2 bytes
// per row; nibble order, per 64-element chunk c of a row (32 bytes):
//   byte 32c + j = (q[64c + j] & 0xF) | (q[64c + 32 + j] << 4),   j in [0, 32)
// (low nibbles are the chunk's first half, high nibbles its second half: the SIMD decode
// then yields elements in natural order). Needs group % 64 == 0 and k % group == 0.
struct Int4Matrix {
  const uint8_t* q = nullptr;
  const uint16_t* scale = nullptr;
  int64_t n = 0;
  int64_t k = 0;
  int64_t group = 64;
};

// Plain bf16 weight [n, k], row-major (row stride k elements), raw bf16 bits: no scales,
// so each output is one f32 sum over the whole row (products bf16 x bf16 exact in f32).
// Any k >= 1 (the SIMD paths mask the last partial vector of a row). The AVX-512 path's
// vdpbf16ps treats bf16 subnormals (|v| < 2^-126) as zero and flushes subnormal sums,
// by its ISA definition; the AVX2 and portable paths keep them.
struct Bf16Matrix {
  const uint16_t* w = nullptr;
  int64_t n = 0;
  int64_t k = 0;
};

// kBf16's packed activation layout is the natural order on every ISA (zero padded).
enum class WeightFormat : int { kFp8 = 0, kInt4 = 1, kBf16 = 2 };

// The ISA a kernel call really runs: `requested` clamped to what this build and CPU
// support.
Isa gemm_isa(Isa requested);

// Elements per packed activation row: k rounded up to a multiple of 64 (zero padded).
int64_t packed_x_stride(int64_t k);

// Column of x that packed position p (in [0, packed_x_stride(k))) holds for (isa, fmt);
// >= k for zero padding. A bijection within each 64-chunk (FP8) or 128-block (INT4).
// `resolved` is an isa as returned by gemm_isa: callers resolve once, this runs per element.
int64_t packed_x_source(Isa resolved, WeightFormat fmt, int64_t k, int64_t p);

// Round x [m, k] (row stride ldx elements) to bf16 and lay it out for (isa, fmt) in
// xp [m, packed_x_stride(k)]. bf16 input (raw bits) is copied/permuted without rounding.
void pack_x_f32(Isa isa, WeightFormat fmt, const float* x, int64_t m, int64_t ldx, int64_t k,
                uint16_t* xp);
void pack_x_bf16(Isa isa, WeightFormat fmt, const uint16_t* x, int64_t m, int64_t ldx,
                 int64_t k, uint16_t* xp);

// y[i, j - n0 + ...]: writes y[i * ldy + j] for i in [0, m), j in [n0, n1) — output
// columns [n0, n1) for all m rows, on the calling thread. xp from pack_x_* (same isa).
//   void fp8_gemm_rows(Isa isa, const uint16_t* xp, int64_t m, const Fp8Matrix& w,
//                      int64_t n0, int64_t n1, float* y, int64_t ldy);
template <typename Matrix>
using GemmRowsFn = void(Isa isa, const uint16_t* xp, int64_t m, const Matrix& w, int64_t n0,
                        int64_t n1, float* y, int64_t ldy);
GemmRowsFn<Fp8Matrix> fp8_gemm_rows;
GemmRowsFn<Int4Matrix> int4_gemm_rows;
GemmRowsFn<Bf16Matrix> bf16_gemm_rows;

// Empty when the matrix is valid, else a one-line message naming the field.
std::string check_fp8(const Fp8Matrix& w);
std::string check_int4(const Int4Matrix& w);
std::string check_bf16(const Bf16Matrix& w);

// Packed activation buffers: 64-byte aligned, so that the kernels' 64-byte x loads never
// split a cache line (std::vector's 16-byte alignment made every x load a split: measured
// on one core, L2-resident weights, M = 3-8: 10-20% slower).
template <typename T>
struct Aligned64Alloc {
  using value_type = T;
  Aligned64Alloc() = default;
  template <typename U>
  Aligned64Alloc(const Aligned64Alloc<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64Alloc<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64Alloc<U>&) const { return false; }
};
using PackedX = std::vector<uint16_t, Aligned64Alloc<uint16_t>>;

// Scalar helpers (exact decode tables, bf16 rounding) shared by the portable path.
float fp8_e4m3_to_f32(uint8_t code);  // NaN codes 0x7F / 0xFF -> quiet NaN
uint16_t f32_to_bf16_rne(float v);
float bf16_to_f32(uint16_t bits);

// ---- per-ISA entry points (defined in gemm_portable.cc / gemm_avx2.cc / gemm_avx512.cc;
// the dispatchers above pick one; call those, not these) ----
// The same without the Isa argument: e.g. fp8_gemm_rows_avx512(xp, m, w, n0, n1, y, ldy).
template <typename Matrix>
using IsaGemmRowsFn = void(const uint16_t* xp, int64_t m, const Matrix& w, int64_t n0,
                           int64_t n1, float* y, int64_t ldy);
IsaGemmRowsFn<Fp8Matrix> fp8_gemm_rows_portable, fp8_gemm_rows_avx2, fp8_gemm_rows_avx512;
IsaGemmRowsFn<Int4Matrix> int4_gemm_rows_portable, int4_gemm_rows_avx2, int4_gemm_rows_avx512;
IsaGemmRowsFn<Bf16Matrix> bf16_gemm_rows_portable, bf16_gemm_rows_avx2, bf16_gemm_rows_avx512;
// The AVX2 paths' prefill GEMM (gemm_prefill_avx2.cc), which their *_gemm_rows_avx2 call
// from kAvx2GemmMinRows activation rows (x in the AVX2 layout, natural order).
constexpr int64_t kAvx2GemmMinRows = 16;
IsaGemmRowsFn<Fp8Matrix> fp8_gemm_prefill_avx2;
IsaGemmRowsFn<Int4Matrix> int4_gemm_prefill_avx2;
// pack_x_f32 / pack_x_bf16 for the AVX-512 layouts (exactly one of xf, xb non-null).
void pack_x_avx512(WeightFormat fmt, const float* xf, const uint16_t* xb, int64_t m,
                   int64_t ldx, int64_t k, uint16_t* xp);
// AVX-512 FP8 with m >= this uses the decoded-panel kernel (default 12); for benchmarks.
void set_fp8_panel_min_m(int m);
// Sum (mod 2^64) of a byte buffer's little-endian 64-bit words, plus its last < 8 bytes
// one by one, read with the widest loads (bandwidth probe). Call with 8-byte aligned
// chunk starts so that chunked sums add up to the whole buffer's.
uint64_t read_sum_portable(const uint8_t* p, int64_t nbytes);
uint64_t read_sum_avx512(const uint8_t* p, int64_t nbytes);

// ---- threads ----
// Runs fn(task) for task in [0, n_tasks) on the process-wide ThreadPool (thread_pool.h,
// shared with the MoE op) with `num_threads` threads in all, capped at the pool's size
// (the caller is one of them; 0 = the whole pool).
// The caller takes tasks too (work stealing through one atomic counter), so it never
// waits on a task that has not started. Calls from several threads are serialised; a
// call from inside a task runs its tasks inline on that thread (no deadlock).
void parallel_for(int64_t n_tasks, int num_threads, const std::function<void(int64_t)>& fn);
int hardware_threads();  // the pool's size (HMOE_NUM_THREADS or the hardware's threads)

}  // namespace hmoe
