#include "cpu_features.h"

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hmoe {
namespace {

bool request_amx_permission() {
#if defined(__x86_64__) && defined(__linux__)
  // Linux hides AMX tile state until a process asks for it (arch_prctl XCOMP_PERM).
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16");
  f.amx_bf16 = f.avx512 && __builtin_cpu_supports("amx-bf16") &&
               __builtin_cpu_supports("amx-tile") && request_amx_permission();
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

Isa select_isa(int max_isa) {
  const CpuFeatures& f = cpu_features();
  Isa best = Isa::kPortable;
  if (f.avx2) best = Isa::kAvx2;
  if (f.avx512) best = Isa::kAvx512;
  if (max_isa >= 0 && static_cast<int>(best) > max_isa) best = static_cast<Isa>(max_isa);
  return best;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kPortable: return "portable";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

}  // namespace hmoe
