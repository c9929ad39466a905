// Scratch buffers for the ISA-specific translation units (*_avx512.cc, *_avx2.cc).
//
// Never use std::vector (or any std template that portable code also instantiates) in such
// a file: the template's out-of-line members (e.g. std::vector<float>::_M_default_append)
// are emitted there as weak (COMDAT) symbols compiled with that file's ISA flags, and the
// linker keeps ONE copy for the whole extension. Portable code then calls an AVX-512
// std::vector member on a CPU without AVX-512: SIGILL (found on an AVX2-only EPYC, where
// growing the MoE op's PackedX from M=1 to M=2 ran vmovdqu16 zmm). IsaScratch lives in an
// unnamed namespace, so every translation unit gets its own internal copy, compiled with
// its own flags and called only from its own (dispatch-guarded) code. CMakeLists.txt
// checks after each build that no ISA object defines a weak symbol.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

namespace {

template <class T>
class IsaScratch {
 public:
  IsaScratch() = default;
  IsaScratch(const IsaScratch&) = delete;
  IsaScratch& operator=(const IsaScratch&) = delete;
  ~IsaScratch() { std::free(p_); }

  // At least n elements, 64-byte aligned (a zmm load never splits a cache line). The
  // contents are scratch: not kept when the buffer grows.
  T* reserve(size_t n) {
    if (n > n_) {
      std::free(p_);
      const size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
      p_ = static_cast<T*>(std::aligned_alloc(64, bytes));
      if (p_ == nullptr) throw std::bad_alloc();
      n_ = n;
    }
    return p_;
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace
