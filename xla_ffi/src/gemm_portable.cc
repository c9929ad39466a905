// Portable C++ FP8 / INT4 GEMM kernels, activation packing, validation and the ISA
// dispatchers of gemm_kernels.h. Compiled without ISA flags: this is what runs on a CPU
// without AVX2, and what tests force with max_isa = 0.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "gemm_kernels.h"

namespace hmoe {
namespace {

// Exact f32 value of every e4m3fn code: sign, 4 exponent bits (bias 7), 3 mantissa bits;
// exponent 0 is subnormal (m * 2^-9); S.1111.111 is NaN (e4m3fn has no infinities).
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 0xF, mant = c & 7;
      float mag;
      if ((c & 0x7F) == 0x7F) {
        mag = std::numeric_limits<float>::quiet_NaN();
      } else if (e == 0) {
        mag = std::ldexp(static_cast<float>(mant), -9);
      } else {
        mag = std::ldexp(1.0f + mant / 8.0f, e - 7);
      }
      v[c] = (c & 0x80) ? -mag : mag;
    }
  }
};

const Fp8Table& fp8_table() {
  static const Fp8Table t;
  return t;
}

// Element index (within its 64-chunk) of packed position p for the AVX-512 FP8 kernel:
// it decodes 64 codes into two bf16 vectors with unpacklo/hi_epi8, which interleave per
// 128-bit lane, so vector A holds chunk elements {0-7, 16-23, 32-39, 48-55} and B the rest.
inline int64_t avx512_fp8_source(int64_t p) {
  const int64_t half = p / 32, i = p % 32;
  return 16 * (i / 8) + 8 * half + (i % 8);
}

// Element index (within its 128-block) of packed position p for the AVX-512 INT4 kernel on a
// whole 128-block: vector t = p / 32 holds nibble t of the line's 32 words, and word i's
// nibbles are elements 2i', 32+2i', 2i'+1, 33+2i' of chunk i / 16 (i' = i % 16).
inline int64_t avx512_int4_source(int64_t p) {
  const int64_t t = p / 32, i = p % 32;
  return 64 * (i / 16) + 32 * (t & 1) + 2 * (i % 16) + (t >> 1);
}

void pack_x(Isa isa, WeightFormat fmt, const float* xf, const uint16_t* xb, int64_t m,
            int64_t ldx, int64_t k, uint16_t* xp) {
  const int64_t ks = packed_x_stride(k);
  const Isa resolved = gemm_isa(isa);
  if (resolved == Isa::kAvx512) return pack_x_avx512(fmt, xf, xb, m, ldx, k, xp);
  for (int64_t i = 0; i < m; ++i) {
    uint16_t* out = xp + i * ks;
    for (int64_t p = 0; p < ks; ++p) {
      const int64_t src = packed_x_source(resolved, fmt, k, p);
      uint16_t v = 0;  // padding to a whole 64-chunk is zero
      if (src < k) v = xf ? f32_to_bf16_rne(xf[i * ldx + src]) : xb[i * ldx + src];
      out[p] = v;
    }
  }
}

}  // namespace

int64_t packed_x_source(Isa resolved, WeightFormat fmt, int64_t k, int64_t p) {
  if (resolved != Isa::kAvx512 || fmt == WeightFormat::kBf16) return p;
  if (fmt == WeightFormat::kFp8) return (p / 64) * 64 + avx512_fp8_source(p % 64);
  // INT4: whole 128-blocks permuted, a trailing 64-chunk (k % 128 == 64) in natural order
  if ((p / 128 + 1) * 128 > k) return p;
  return (p / 128) * 128 + avx512_int4_source(p % 128);
}

float fp8_e4m3_to_f32(uint8_t code) { return fp8_table().v[code]; }

uint16_t f32_to_bf16_rne(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_to_f32(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

Isa gemm_isa(Isa requested) { return select_isa(static_cast<int>(requested)); }

int64_t packed_x_stride(int64_t k) { return (k + 63) / 64 * 64; }

void pack_x_f32(Isa isa, WeightFormat fmt, const float* x, int64_t m, int64_t ldx, int64_t k,
                uint16_t* xp) {
  pack_x(isa, fmt, x, nullptr, m, ldx, k, xp);
}

void pack_x_bf16(Isa isa, WeightFormat fmt, const uint16_t* x, int64_t m, int64_t ldx,
                 int64_t k, uint16_t* xp) {
  pack_x(isa, fmt, nullptr, x, m, ldx, k, xp);
}

std::string check_fp8(const Fp8Matrix& w) {
  if (w.n <= 0 || w.k <= 0)
    return "fp8 weight: shape [" + std::to_string(w.n) + ", " + std::to_string(w.k) +
           "] must be non-empty";
  if (w.block_n <= 0 || w.block_k <= 0 || w.block_k % 64 != 0)
    return "fp8 weight: block_k must be a positive multiple of 64 and block_n positive, got "
           "block_n=" + std::to_string(w.block_n) + " block_k=" + std::to_string(w.block_k);
  return "";
}

std::string check_int4(const Int4Matrix& w) {
  if (w.n <= 0 || w.k <= 0)
    return "int4 weight: shape [" + std::to_string(w.n) + ", " + std::to_string(w.k) +
           "] must be non-empty";
  if (w.group <= 0 || w.group % 64 != 0)
    return "int4 weight: group must be a positive multiple of 64, got " +
           std::to_string(w.group);
  if (w.k % w.group != 0)
    return "int4 weight: k=" + std::to_string(w.k) + " must be a multiple of group=" +
           std::to_string(w.group);
  return "";
}

std::string check_bf16(const Bf16Matrix& w) {
  if (w.n <= 0 || w.k <= 0)
    return "bf16 weight: shape [" + std::to_string(w.n) + ", " + std::to_string(w.k) +
           "] must be non-empty";
  return "";
}

namespace {

template <typename Matrix>
void dispatch_rows(IsaGemmRowsFn<Matrix>* portable, IsaGemmRowsFn<Matrix>* avx2,
                   IsaGemmRowsFn<Matrix>* avx512, Isa isa, const uint16_t* xp, int64_t m,
                   const Matrix& w, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  switch (gemm_isa(isa)) {
    case Isa::kAvx512: return avx512(xp, m, w, n0, n1, y, ldy);
    case Isa::kAvx2: return avx2(xp, m, w, n0, n1, y, ldy);
    case Isa::kPortable: return portable(xp, m, w, n0, n1, y, ldy);
  }
}

}  // namespace

void fp8_gemm_rows(Isa isa, const uint16_t* xp, int64_t m, const Fp8Matrix& w, int64_t n0,
                   int64_t n1, float* y, int64_t ldy) {
  dispatch_rows(fp8_gemm_rows_portable, fp8_gemm_rows_avx2, fp8_gemm_rows_avx512, isa, xp, m,
                w, n0, n1, y, ldy);
}

void int4_gemm_rows(Isa isa, const uint16_t* xp, int64_t m, const Int4Matrix& w, int64_t n0,
                    int64_t n1, float* y, int64_t ldy) {
  dispatch_rows(int4_gemm_rows_portable, int4_gemm_rows_avx2, int4_gemm_rows_avx512, isa, xp,
                m, w, n0, n1, y, ldy);
}

void bf16_gemm_rows(Isa isa, const uint16_t* xp, int64_t m, const Bf16Matrix& w, int64_t n0,
                    int64_t n1, float* y, int64_t ldy) {
  dispatch_rows(bf16_gemm_rows_portable, bf16_gemm_rows_avx2, bf16_gemm_rows_avx512, isa, xp,
                m, w, n0, n1, y, ldy);
}

// Portable FP8: row by row; each decoded weight is reused for all m activation rows.
void fp8_gemm_rows_portable(const uint16_t* xp, int64_t m, const Fp8Matrix& w, int64_t n0,
                            int64_t n1, float* y, int64_t ldy) {
  const float* tbl = fp8_table().v;
  const int64_t ks = packed_x_stride(w.k), nkb = (w.k + w.block_k - 1) / w.block_k;
  constexpr int64_t kMb = 8;  // activation rows per pass (accumulators on the stack)
  for (int64_t r = n0; r < n1; ++r) {
    const uint8_t* wr = w.w + r * w.k;
    const float* srow = w.scale + (r / w.block_n) * nkb;
    for (int64_t i0 = 0; i0 < m; i0 += kMb) {
      const int64_t mb = std::min(kMb, m - i0);
      float tot[kMb] = {0};
      for (int64_t kb = 0; kb < nkb; ++kb) {
        float blk[kMb] = {0};
        const int64_t k1 = std::min(w.k, (kb + 1) * w.block_k);
        for (int64_t kk = kb * w.block_k; kk < k1; ++kk) {
          const float wv = tbl[wr[kk]];
          for (int64_t i = 0; i < mb; ++i) blk[i] += bf16_to_f32(xp[(i0 + i) * ks + kk]) * wv;
        }
        for (int64_t i = 0; i < mb; ++i) tot[i] += blk[i] * srow[kb];
      }
      for (int64_t i = 0; i < mb; ++i) y[(i0 + i) * ldy + r] = tot[i];
    }
  }
}

// Portable INT4 with the nibble order of Int4Matrix.
void int4_gemm_rows_portable(const uint16_t* xp, int64_t m, const Int4Matrix& w, int64_t n0,
                             int64_t n1, float* y, int64_t ldy) {
  const int64_t ks = packed_x_stride(w.k), ng = w.k / w.group;
  constexpr int64_t kMb = 8;
  for (int64_t r = n0; r < n1; ++r) {
    const uint8_t* qr = w.q + r * (w.k / 2);
    const uint16_t* srow = w.scale + r * ng;
    for (int64_t i0 = 0; i0 < m; i0 += kMb) {
      const int64_t mb = std::min(kMb, m - i0);
      float tot[kMb] = {0};
      for (int64_t g = 0; g < ng; ++g) {
        float blk[kMb] = {0};
        for (int64_t c = g * w.group; c < (g + 1) * w.group; c += 64) {
          const uint8_t* qc = qr + c / 2;
          for (int64_t j = 0; j < 32; ++j) {
            // two's-complement nibbles: (v ^ 8) - 8 sign-extends 4 bits
            const float lo = static_cast<float>(((qc[j] & 0xF) ^ 8) - 8);
            const float hi = static_cast<float>(((qc[j] >> 4) ^ 8) - 8);
            for (int64_t i = 0; i < mb; ++i) {
              const uint16_t* xr = xp + (i0 + i) * ks + c;
              blk[i] += bf16_to_f32(xr[j]) * lo + bf16_to_f32(xr[32 + j]) * hi;
            }
          }
        }
        const float s = bf16_to_f32(srow[g]);
        for (int64_t i = 0; i < mb; ++i) tot[i] += blk[i] * s;
      }
      for (int64_t i = 0; i < mb; ++i) y[(i0 + i) * ldy + r] = tot[i];
    }
  }
}

// Portable BF16: row by row, one f32 sum per output in k order; each weight is converted
// once and reused for up to kMb activation rows.
void bf16_gemm_rows_portable(const uint16_t* xp, int64_t m, const Bf16Matrix& w, int64_t n0,
                             int64_t n1, float* y, int64_t ldy) {
  const int64_t ks = packed_x_stride(w.k);
  constexpr int64_t kMb = 8;
  for (int64_t r = n0; r < n1; ++r) {
    const uint16_t* wr = w.w + r * w.k;
    for (int64_t i0 = 0; i0 < m; i0 += kMb) {
      const int64_t mb = std::min(kMb, m - i0);
      float tot[kMb] = {0};
      for (int64_t kk = 0; kk < w.k; ++kk) {
        const float wv = bf16_to_f32(wr[kk]);
        for (int64_t i = 0; i < mb; ++i) tot[i] += bf16_to_f32(xp[(i0 + i) * ks + kk]) * wv;
      }
      for (int64_t i = 0; i < mb; ++i) y[(i0 + i) * ldy + r] = tot[i];
    }
  }
}

uint64_t read_sum_portable(const uint8_t* p, int64_t nbytes) {
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 32 <= nbytes; i += 32) {
    uint64_t v[4];
    std::memcpy(v, p + i, 32);
    s0 += v[0];
    s1 += v[1];
    s2 += v[2];
    s3 += v[3];
  }
  for (; i + 8 <= nbytes; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    s0 += v;
  }
  for (; i < nbytes; ++i) s0 += p[i];  // a last partial word counts byte by byte
  return s0 + s1 + s2 + s3;
}

}  // namespace hmoe
