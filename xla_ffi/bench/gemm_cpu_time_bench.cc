// Single-thread DRAM benchmark of the FP8 / INT4 M=1 kernels vs the read probe, timed in
// THREAD CPU time, so that time the thread spends descheduled on a shared machine does
// not count (memory stalls do). 1 GiB rotating sets; the prints are bandwidth and the
// kernel/read ratio. Not built by CMake (only xla_ffi/src/*.cc is). Build and run:
//   F="-O3 -std=c++17 -Ixla_ffi/src"; A="-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vbmi -mavx512bf16 -mfma -mf16c -mbmi2"
//   g++ $F -c xla_ffi/src/gemm_portable.cc -o /tmp/p.o && g++ $F -c xla_ffi/src/cpu_features.cc -o /tmp/c.o
//   g++ $F -mavx2 -mfma -mf16c -c xla_ffi/src/gemm_avx2.cc -o /tmp/a2.o && g++ $F $A -c xla_ffi/src/gemm_avx512.cc -o /tmp/a5.o
//   g++ $F xla_ffi/bench/gemm_cpu_time_bench.cc /tmp/p.o /tmp/c.o /tmp/a2.o /tmp/a5.o -o /tmp/gemm_bench
//   /tmp/gemm_bench 2048 7168     # N K
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <time.h>
#include "gemm_kernels.h"
using namespace hmoe;
static double cpu_now(){timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+1e-9*t.tv_nsec;}
int main(int argc, char** argv) {
  int64_t n = atoi(argv[1]), k = atoi(argv[2]); 
  int64_t cnt = (1ll << 30) / (n * k);
  std::vector<uint8_t*> ws; std::vector<uint8_t*> qs;
  for (int i = 0; i < cnt; ++i) { auto* p = (uint8_t*)aligned_alloc(64, n * k); for (int64_t j = 0; j < n * k; ++j) p[j] = j * 7 % 0x7e; ws.push_back(p);
    auto* q = (uint8_t*)aligned_alloc(64, n * k / 2); for (int64_t j = 0; j < n * k / 2; ++j) q[j] = j * 13; qs.push_back(q);}
  std::vector<float> sc(((n + 127) / 128) * ((k + 127) / 128), 1.f), x(k, 1.f), y(n);
  std::vector<uint16_t> s4(n * k / 64, 0x3f80);
  std::vector<uint16_t> xp(packed_x_stride(k)), xq(packed_x_stride(k));
  pack_x_f32(Isa::kAvx512, WeightFormat::kFp8, x.data(), 1, k, k, xp.data());
  pack_x_f32(Isa::kAvx512, WeightFormat::kInt4, x.data(), 1, k, k, xq.data());
  for (int rep = 0; rep < 4; ++rep) {
    double t0 = cpu_now(); uint64_t s = 0;
    for (auto* p : ws) s += read_sum_avx512(p, n * k);
    double t1 = cpu_now();
    for (auto* p : ws) { Fp8Matrix W{p, sc.data(), n, k, 128, 128}; fp8_gemm_rows(Isa::kAvx512, xp.data(), 1, W, 0, n, y.data(), n); }
    double t2 = cpu_now();
    for (auto* q : qs) { Int4Matrix Q{q, s4.data(), n, k, 64}; int4_gemm_rows(Isa::kAvx512, xq.data(), 1, Q, 0, n, y.data(), n); }
    double t3 = cpu_now();
    double B = double(cnt) * n * k;
    printf("read %.1f GB/s  fp8 %.1f GB/s (%.2f)  int4 %.1f GB/s time ratio %.2f  [%lu]\n", B / (t1 - t0) / 1e9, B / (t2 - t1) / 1e9, (t1 - t0) / (t2 - t1), B / 2 / (t3 - t2) / 1e9, (t3 - t2) / (t2 - t1), s & 1);
  }
}
