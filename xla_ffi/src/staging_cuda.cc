// DeviceCopier: the copy-stream / event choreography of the staging ring's GPU side
// (staging_cuda.h says why each wait is where it is). No CUDA headers: the driver API's few
// constants are restated below with their names.
#include "staging_cuda.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>

namespace hmoe {

namespace {
constexpr unsigned kStreamNonBlocking = 0x1;  // CU_STREAM_NON_BLOCKING: no implicit sync with stream 0
constexpr unsigned kEventDisableTiming = 0x2;  // CU_EVENT_DISABLE_TIMING: the cheapest event kind

template <typename F>
void resolve(void* h, const char* name, F* fn, std::string* missing) {
  *fn = reinterpret_cast<F>(dlsym(h, name));
  if (!*fn) *missing += (missing->empty() ? "" : ", ") + std::string(name);
}

// Push a context for the scope (the driver calls below act on the current context).
struct CtxScope {
  const CuDriver* cu;
  bool pushed;
  CtxScope(const CuDriver* c, void* ctx) : cu(c), pushed(ctx && c->ctx_push(ctx) == 0) {}
  ~CtxScope() {
    void* popped = nullptr;
    if (pushed) cu->ctx_pop(&popped);
  }
};
}  // namespace

const CuDriver& real_cuda_driver() {
  static const CuDriver d = [] {
    CuDriver d;
    // Prefer the libcuda the JAX CUDA plugin already loaded: it is the one driver instance
    // every CUDA user in the process shares, so XLA's streams and contexts are valid here.
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!h) h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      d.missing = "libcuda.so.1 (no CUDA driver on this machine)";
      return d;
    }
    resolve(h, "cuStreamGetCtx", &d.stream_get_ctx, &d.missing);
    resolve(h, "cuCtxPushCurrent_v2", &d.ctx_push, &d.missing);
    resolve(h, "cuCtxPopCurrent_v2", &d.ctx_pop, &d.missing);
    resolve(h, "cuStreamCreate", &d.stream_create, &d.missing);
    resolve(h, "cuEventCreate", &d.event_create, &d.missing);
    resolve(h, "cuEventRecord", &d.event_record, &d.missing);
    resolve(h, "cuStreamWaitEvent", &d.stream_wait_event, &d.missing);
    resolve(h, "cuEventSynchronize", &d.event_synchronize, &d.missing);
    resolve(h, "cuMemcpyHtoDAsync_v2", &d.memcpy_htod_async, &d.missing);
    resolve(h, "cuEventDestroy_v2", &d.event_destroy, &d.missing);
    resolve(h, "cuStreamDestroy_v2", &d.stream_destroy, &d.missing);
    return d;
  }();
  return d;
}

DeviceCopier::DeviceCopier(const CuDriver* cu, int n_slots) : cu_(cu), slots_(n_slots) {}

DeviceCopier::~DeviceCopier() {
  for (auto& s : slots_) {
    if (!s.ctx) continue;  // never used: nothing was created for it
    CtxScope scope(cu_, s.ctx);
    if (s.copied) cu_->event_destroy(s.copied);
    if (s.freed) cu_->event_destroy(s.freed);
  }
  for (auto& [ctx, stream] : copy_stream_) {
    CtxScope scope(cu_, ctx);
    if (stream) cu_->stream_destroy(stream);  // returns at once; pending work still completes
  }
}

std::string DeviceCopier::call(int rc, const char* what) {
  return rc == 0 ? "" : std::string(what) + " failed: CUresult " + std::to_string(rc);
}

std::string DeviceCopier::ensure_events(Slot& s) {
  if (!s.copied)
    if (auto e = call(cu_->event_create(&s.copied, kEventDisableTiming), "cuEventCreate"); !e.empty()) return e;
  if (!s.freed)
    if (auto e = call(cu_->event_create(&s.freed, kEventDisableTiming), "cuEventCreate"); !e.empty()) return e;
  return "";
}

std::string DeviceCopier::put(void* xla_stream, int slot, const std::vector<PutCopy>& copies) {
  if (!cu_->ok()) return "CUDA driver API not available: missing " + cu_->missing;
  if (slot < 0 || slot >= int(slots_.size())) return "slot " + std::to_string(slot) + " out of range";
  std::lock_guard<std::mutex> lk(mu_);
  void* ctx = nullptr;
  if (auto e = call(cu_->stream_get_ctx(xla_stream, &ctx), "cuStreamGetCtx"); !e.empty()) return e;
  CtxScope scope(cu_, ctx);
  void*& copy = copy_stream_[ctx];
  if (!copy)
    if (auto e = call(cu_->stream_create(&copy, kStreamNonBlocking), "cuStreamCreate"); !e.empty()) return e;
  Slot& s = slots_[slot];
  if (s.ctx && s.ctx != ctx) return "slot " + std::to_string(slot) + ": its events belong to another CUDA context";
  s.ctx = ctx;
  if (auto e = ensure_events(s); !e.empty()) return e;
  if (s.copy_pending) return "slot " + std::to_string(slot) + ": the previous copy was not waited for";
  if (s.used) {
    // The slot's previous group may still be read by kernels on XLA's stream: wait for the
    // point where the ring released it (write-after-read).
    if (!s.freed_recorded) return "slot " + std::to_string(slot) + " was not released since its last copy";
    if (auto e = call(cu_->stream_wait_event(copy, s.freed, 0), "cuStreamWaitEvent"); !e.empty()) return e;
  }
  for (const auto& c : copies) {
    auto e = call(cu_->memcpy_htod_async(reinterpret_cast<unsigned long long>(c.dst), c.src, c.bytes, copy),
                  "cuMemcpyHtoDAsync");
    if (!e.empty()) return e;
  }
  if (auto e = call(cu_->event_record(s.copied, copy), "cuEventRecord"); !e.empty()) return e;
  s.copy_pending = true;
  s.freed_recorded = false;
  s.used = true;
  ++s.issued;
  s.xla_stream = xla_stream;
  cv_issued_.notify_all();
  return "";
}

std::string DeviceCopier::released(int slot) {
  if (slot < 0 || slot >= int(slots_.size())) return "slot " + std::to_string(slot) + " out of range";
  std::lock_guard<std::mutex> lk(mu_);
  Slot& s = slots_[slot];
  if (!s.used) return "";  // never copied to: nothing can still read it
  CtxScope scope(cu_, s.ctx);
  // Recorded on the stream of the XLA device that read the slot, after its readers were
  // launched (the unload op's deps).
  if (auto e = call(cu_->event_record(s.freed, s.xla_stream), "cuEventRecord"); !e.empty()) return e;
  s.freed_recorded = true;
  return "";
}

std::string DeviceCopier::wait_copied(int slot, uint64_t generation, int64_t timeout_ns, bool* done) {
  *done = false;
  if (slot < 0 || slot >= int(slots_.size())) return "slot " + std::to_string(slot) + " out of range";
  void *ev = nullptr, *ctx = nullptr;
  {
    std::unique_lock<std::mutex> lk(mu_);
    Slot& s = slots_[slot];
    if (!cv_issued_.wait_for(lk, std::chrono::nanoseconds(std::max<int64_t>(timeout_ns, 0)),
                             [&] { return s.issued >= generation; }))
      return "";  // not issued yet
    if (s.issued > generation)
      return "slot " + std::to_string(slot) + ": put " + std::to_string(generation) + " was overtaken by put " +
             std::to_string(s.issued) + " before it was waited for";
    if (!s.copy_pending) {
      *done = true;  // already waited for
      return "";
    }
    ev = s.copied;
    ctx = s.ctx;
  }
  // Outside the lock: another slot's put may be issued meanwhile (the loader of a 2nd device).
  CtxScope scope(cu_, ctx);
  if (auto e = call(cu_->event_synchronize(ev), "cuEventSynchronize"); !e.empty()) return e;
  std::lock_guard<std::mutex> lk(mu_);
  slots_[slot].copy_pending = false;
  *done = true;
  return "";
}

}  // namespace hmoe
