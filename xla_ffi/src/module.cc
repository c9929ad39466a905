// The nanobind extension `_hmoe_ffi`: exposes every registered FFI handler as a
// PyCapsule for jax.ffi.register_ffi_target, CPU feature detection, and the staging ring
// class (staging_bind.cc).
#include <nanobind/nanobind.h>

#include "cpu_features.h"
#include "registry.h"

namespace nb = nanobind;

namespace hmoe {
void bind_staging(nb::module_& m);  // staging_bind.cc

std::vector<FfiTarget>& ffi_targets() {
  static std::vector<FfiTarget> targets;
  return targets;
}
}  // namespace hmoe

NB_MODULE(_hmoe_ffi, m) {
  m.def("registrations", []() {
    nb::dict out;
    for (const auto& t : hmoe::ffi_targets()) {
      if (t.instantiate) {
        nb::dict stages;
        stages["instantiate"] = nb::capsule(t.instantiate);
        stages["execute"] = nb::capsule(t.execute);
        out[t.name.c_str()] = stages;
      } else {
        out[t.name.c_str()] = nb::capsule(t.execute);
      }
    }
    return out;
  });
  m.def("cpu_features", []() {
    const auto& f = hmoe::cpu_features();
    nb::dict d;
    d["avx2"] = f.avx2;
    d["avx512"] = f.avx512;
    d["amx_bf16"] = f.amx_bf16;
    d["best_isa"] = hmoe::isa_name(hmoe::select_isa());
    return d;
  });
  hmoe::bind_staging(m);
}
