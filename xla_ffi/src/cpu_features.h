// Run-time ISA detection shared by all kernels. Kernels pick a path once per call from
// this (or from an explicit override, so tests can force the fallback paths on a machine
// that has AVX-512).
#pragma once

namespace hmoe {

// The ISAs with kernels (gemm_<isa>.cc, gemm_portable.cc). There is no AMX kernel, so AMX is
// a detected CPU feature only, never the ISA a call runs or reports.
enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

struct CpuFeatures {
  bool avx2 = false;         // AVX2 + FMA + F16C
  bool avx512 = false;       // F + BW + VL + DQ + VBMI + BF16
  bool amx_bf16 = false;     // AMX tiles usable by this process: reported only (no kernel of ours)
};

const CpuFeatures& cpu_features();

// Best ISA with a kernel that this CPU supports, capped by `max_isa` (< 0: no cap).
Isa select_isa(int max_isa = -1);

const char* isa_name(Isa isa);

}  // namespace hmoe
