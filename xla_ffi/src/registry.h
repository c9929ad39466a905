// A process-wide list of FFI handlers. Each kernel file registers its handlers with
// HMOE_FFI_TARGET, so adding a kernel never touches module.cc.
#pragma once

#include <string>
#include <vector>

namespace hmoe {

struct FfiTarget {
  std::string name;   // XLA custom-call target, always prefixed "hmoe_"
  void* execute;      // XLA_FFI_Handler* for the execute stage
  void* instantiate;  // optional XLA_FFI_Handler* for the instantiate stage (nullptr if none)
};

std::vector<FfiTarget>& ffi_targets();

struct RegisterFfiTarget {
  RegisterFfiTarget(const char* name, void* execute, void* instantiate = nullptr) {
    ffi_targets().push_back({name, execute, instantiate});
  }
};

}  // namespace hmoe

#define HMOE_CONCAT_INNER(a, b) a##b
#define HMOE_CONCAT(a, b) HMOE_CONCAT_INNER(a, b)
// HMOE_FFI_TARGET("hmoe_name", HandlerSymbol) or
// HMOE_FFI_TARGET("hmoe_name", ExecuteSymbol, InstantiateSymbol)
#define HMOE_FFI_TARGET(name, ...)                                              \
  static ::hmoe::RegisterFfiTarget HMOE_CONCAT(hmoe_ffi_target_, __LINE__)(   \
      name, HMOE_FFI_PTRS(__VA_ARGS__))
#define HMOE_FFI_PTRS(...) HMOE_FFI_PTRS_N(__VA_ARGS__, HMOE_FFI_PTRS2, HMOE_FFI_PTRS1)(__VA_ARGS__)
#define HMOE_FFI_PTRS_N(_1, _2, NAME, ...) NAME
#define HMOE_FFI_PTRS1(e) reinterpret_cast<void*>(e)
#define HMOE_FFI_PTRS2(e, i) reinterpret_cast<void*>(e), reinterpret_cast<void*>(i)
