// bf16 bits -> f32 inline, for the ISA kernel files' per-group scales (a call into the
// portable translation unit per group cost ~40% at M = 1). Unnamed namespace: each
// translation unit gets its own copy, compiled with its own ISA flags (isa_scratch.h says
// why ISA files must not share out-of-line code).
#pragma once

#include <cstdint>
#include <cstring>

namespace {

inline float scale_bf16(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

}  // namespace
