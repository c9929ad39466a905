// StagingRing implementation, its C API (ctypes: hmoe_ring_*) and the XLA FFI target
// hmoe_staging_wait (block inside a computation until a slot is filled).
#include "staging.h"

#include <dlfcn.h>
#include <time.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace hmoe {

namespace {
constexpr size_t kAlign = 4096;             // page-aligned slots (>= the 64 B JAX needs for zero-copy)
constexpr size_t kChunkBytes = 1 << 20;     // unit of work shared by the copy threads

// On a GPU host, page-lock the arena so host->device copies can DMA from it directly.
// cudart is optional: without it (CPU-only hosts) the arena is just aligned memory.
void* cudart() {
  for (const char* lib : {"libcudart.so.12", "libcudart.so.13", "libcudart.so"}) {
    // Prefer the cudart the JAX CUDA plugin already loaded (same driver context).
    if (void* h = dlopen(lib, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) return h;
  }
  for (const char* lib : {"libcudart.so.12", "libcudart.so.13", "libcudart.so"}) {
    if (void* h = dlopen(lib, RTLD_NOW | RTLD_LOCAL)) return h;
  }
  return nullptr;
}

bool try_pin(void* p, size_t bytes) {
  if (const char* env = std::getenv("HMOE_STAGING_PIN"); env && std::string(env) == "0") return false;
  void* h = cudart();
  if (!h) return false;
  using RegFn = int (*)(void*, size_t, unsigned);
  auto reg = reinterpret_cast<RegFn>(dlsym(h, "cudaHostRegister"));
  constexpr unsigned kPortable = 1;  // cudaHostRegisterPortable: pinned for every CUDA context
  return reg && reg(p, bytes, kPortable) == 0;
}

void unpin(void* p) {
  void* h = cudart();
  if (!h) return;
  using UnregFn = int (*)(void*);
  if (auto unreg = reinterpret_cast<UnregFn>(dlsym(h, "cudaHostUnregister"))) unreg(p);
}
}  // namespace

int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // the clock of Python's time.perf_counter_ns on Linux
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

StagingRing::StagingRing(int n_slots, size_t slot_bytes, int n_threads, double rate_bytes_per_s)
    : slots_(n_slots, SlotState::kFree),
      start_ns_(n_slots, 0),
      end_ns_(n_slots, 0),
      slot_bytes_((slot_bytes + kAlign - 1) / kAlign * kAlign),
      rate_(rate_bytes_per_s) {
  size_t total = slot_bytes_ * static_cast<size_t>(n_slots);
  arena_ = static_cast<uint8_t*>(std::aligned_alloc(kAlign, std::max(total, kAlign)));
  if (arena_) {
    // Touch every page now, not during the first fill (a plain memset(0) after the
    // allocation may be folded into calloc semantics and touch nothing).
    volatile uint8_t* v = arena_;
    for (size_t off = 0; off < total; off += 4096) v[off] = 1;
    pinned_ = try_pin(arena_, total);
  }
  link_ = std::thread([this] { link_loop(); });
  for (int i = 1; i < n_threads; ++i) helpers_.emplace_back([this] { helper_loop(); });
}

StagingRing::~StagingRing() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_jobs_.notify_all();
  {
    std::lock_guard<std::mutex> lk(work_mu_);
    generation_ = ~0ull;
  }
  cv_work_.notify_all();
  link_.join();
  for (auto& t : helpers_) t.join();
  if (pinned_) unpin(arena_);
  std::free(arena_);
}

std::string StagingRing::fill(int slot, std::vector<CopySegment> segments) {
  if (slot < 0 || slot >= n_slots()) return "fill: slot " + std::to_string(slot) + " out of range [0, " + std::to_string(n_slots()) + ")";
  for (const auto& s : segments) {
    if (s.dst_offset + s.bytes > slot_bytes_)
      return "fill: segment [" + std::to_string(s.dst_offset) + ", +" + std::to_string(s.bytes) +
             ") exceeds slot_bytes " + std::to_string(slot_bytes_);
    if (!s.src && s.bytes) return "fill: null source pointer";
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (slots_[slot] != SlotState::kFree)
    return "fill: slot " + std::to_string(slot) + " is not free (state " + std::to_string(int(slots_[slot])) +
           "); release it after its last use";
  slots_[slot] = SlotState::kFilling;
  jobs_.push_back(Job{slot, std::move(segments), monotonic_ns()});
  cv_jobs_.notify_one();
  return "";
}

std::string StagingRing::wait(int slot, int64_t* start_ns, int64_t* end_ns) {
  if (slot < 0 || slot >= n_slots()) return "wait: slot " + std::to_string(slot) + " out of range";
  std::unique_lock<std::mutex> lk(mu_);
  if (slots_[slot] == SlotState::kFree) return "wait: slot " + std::to_string(slot) + " has no fill queued";
  cv_ready_.wait(lk, [&] { return slots_[slot] == SlotState::kReady; });
  *start_ns = start_ns_[slot];
  *end_ns = end_ns_[slot];
  return "";
}

std::string StagingRing::release(int slot) {
  if (slot < 0 || slot >= n_slots()) return "release: slot " + std::to_string(slot) + " out of range";
  std::lock_guard<std::mutex> lk(mu_);
  if (slots_[slot] != SlotState::kReady) return "release: slot " + std::to_string(slot) + " is not ready";
  slots_[slot] = SlotState::kFree;
  return "";
}

int StagingRing::state(int slot) {
  std::lock_guard<std::mutex> lk(mu_);
  return (slot < 0 || slot >= n_slots()) ? -1 : int(slots_[slot]);
}

bool StagingRing::set_pinned(bool on) {
  size_t total = slot_bytes_ * slots_.size();
  if (on && !pinned_) pinned_ = try_pin(arena_, total);
  if (!on && pinned_) {
    unpin(arena_);
    pinned_ = false;
  }
  return pinned_;
}

void StagingRing::bind_device(uintptr_t device_ptr, int slot) {
  std::lock_guard<std::mutex> lk(mu_);
  bound_[device_ptr] = slot;
}

int StagingRing::bound_slot(uintptr_t device_ptr) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = bound_.find(device_ptr);
  return it == bound_.end() ? -1 : it->second;
}

void StagingRing::link_loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_jobs_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    int64_t t0 = monotonic_ns();
    copy_job(job);
    int64_t t1 = monotonic_ns();
    {
      std::lock_guard<std::mutex> lk(mu_);
      start_ns_[job.slot] = t0;
      end_ns_[job.slot] = t1;
      slots_[job.slot] = SlotState::kReady;
    }
    fills_done_.fetch_add(1);
    cv_ready_.notify_all();
  }
}

void StagingRing::copy_job(const Job& job) {
  chunks_.clear();
  for (size_t i = 0; i < job.segments.size(); ++i)
    for (size_t off = 0; off < job.segments[i].bytes; off += kChunkBytes) chunks_.emplace_back(i, off);
  {
    std::lock_guard<std::mutex> lk(work_mu_);
    current_ = &job;
    next_chunk_ = 0;
    paced_bytes_ = 0;
    int64_t now = monotonic_ns();
    job_start_ns_ = link_due_ns_ >= job.enqueue_ns ? link_due_ns_ : now;
    ++generation_;
  }
  cv_work_.notify_all();
  copy_chunks();  // the link thread copies too
  std::unique_lock<std::mutex> lk(work_mu_);
  current_ = nullptr;  // helpers that wake late find no work
  cv_work_done_.wait(lk, [&] { return busy_helpers_ == 0; });
  if (rate_ > 0) {
    size_t total = 0;
    for (const auto& seg : job.segments) total += seg.bytes;
    link_due_ns_ = job_start_ns_ + static_cast<int64_t>(1e9 * double(total) / rate_);
  }
}

void StagingRing::copy_chunks() {
  const Job* job = current_;
  for (;;) {
    size_t c = next_chunk_.fetch_add(1);
    if (c >= chunks_.size()) return;
    auto [si, off] = chunks_[c];
    const CopySegment& s = job->segments[si];
    size_t n = std::min(kChunkBytes, s.bytes - off);
    if (rate_ > 0) {
      // Link emulation: the chunk may not finish before (bytes so far) / rate.
      size_t before = paced_bytes_.fetch_add(n) + n;
      int64_t due = job_start_ns_ + static_cast<int64_t>(1e9 * double(before) / rate_);
      std::memcpy(slot_ptr(job->slot) + s.dst_offset + off, s.src + off, n);
      int64_t now = monotonic_ns();
      if (due > now) {
        timespec ts{static_cast<time_t>((due - now) / 1000000000LL), static_cast<long>((due - now) % 1000000000LL)};
        nanosleep(&ts, nullptr);
      }
    } else {
      std::memcpy(slot_ptr(job->slot) + s.dst_offset + off, s.src + off, n);
    }
    bytes_copied_.fetch_add(n);
  }
}

void StagingRing::helper_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(work_mu_);
      cv_work_.wait(lk, [&] { return generation_ != seen; });
      if (generation_ == ~0ull) return;
      seen = generation_;
      if (!current_) continue;
      ++busy_helpers_;
    }
    copy_chunks();
    {
      std::lock_guard<std::mutex> lk(work_mu_);
      --busy_helpers_;
    }
    cv_work_done_.notify_all();
  }
}

}  // namespace hmoe

// ---- C API for ctypes (hmoe_jax/runtime/staging.py). Errors: return != 0 and the message
// in hmoe_ring_last_error() (thread-local).
namespace {
thread_local std::string g_last_error;
int fail(const std::string& msg) {
  g_last_error = msg;
  return msg.empty() ? 0 : -1;
}
}  // namespace

extern "C" {
__attribute__((visibility("default"))) const char* hmoe_ring_last_error() { return g_last_error.c_str(); }

__attribute__((visibility("default"))) void* hmoe_ring_create(int n_slots, uint64_t slot_bytes, int n_threads,
                                                              double rate_bytes_per_s) {
  if (n_slots < 1 || slot_bytes == 0 || n_threads < 1) {
    g_last_error = "create: need n_slots >= 1, slot_bytes > 0, n_threads >= 1";
    return nullptr;
  }
  auto* r = new hmoe::StagingRing(n_slots, slot_bytes, n_threads, rate_bytes_per_s);
  if (!r->slot_ptr(0)) {
    g_last_error = "create: could not allocate " + std::to_string(n_slots * slot_bytes) + " bytes";
    delete r;
    return nullptr;
  }
  return r;
}

__attribute__((visibility("default"))) void hmoe_ring_destroy(void* ring) { delete static_cast<hmoe::StagingRing*>(ring); }

__attribute__((visibility("default"))) uint64_t hmoe_ring_slot_ptr(void* ring, int slot) {
  return reinterpret_cast<uint64_t>(static_cast<hmoe::StagingRing*>(ring)->slot_ptr(slot));
}

__attribute__((visibility("default"))) uint64_t hmoe_ring_slot_bytes(void* ring) {
  return static_cast<hmoe::StagingRing*>(ring)->slot_bytes();
}

__attribute__((visibility("default"))) int hmoe_ring_pinned(void* ring) { return static_cast<hmoe::StagingRing*>(ring)->pinned(); }

__attribute__((visibility("default"))) int hmoe_ring_fill(void* ring, int slot, int n, const uint64_t* src,
                                                          const uint64_t* dst_offset, const uint64_t* bytes) {
  std::vector<hmoe::CopySegment> segs(n);
  for (int i = 0; i < n; ++i) segs[i] = {reinterpret_cast<const uint8_t*>(src[i]), dst_offset[i], bytes[i]};
  return fail(static_cast<hmoe::StagingRing*>(ring)->fill(slot, std::move(segs)));
}

__attribute__((visibility("default"))) int hmoe_ring_wait(void* ring, int slot, int64_t* start_ns, int64_t* end_ns) {
  return fail(static_cast<hmoe::StagingRing*>(ring)->wait(slot, start_ns, end_ns));
}

__attribute__((visibility("default"))) int hmoe_ring_release(void* ring, int slot) {
  return fail(static_cast<hmoe::StagingRing*>(ring)->release(slot));
}

__attribute__((visibility("default"))) int hmoe_ring_state(void* ring, int slot) {
  return static_cast<hmoe::StagingRing*>(ring)->state(slot);
}

__attribute__((visibility("default"))) uint64_t hmoe_ring_bytes_copied(void* ring) {
  return static_cast<hmoe::StagingRing*>(ring)->bytes_copied();
}

__attribute__((visibility("default"))) uint64_t hmoe_ring_fills_done(void* ring) {
  return static_cast<hmoe::StagingRing*>(ring)->fills_done();
}

__attribute__((visibility("default"))) int hmoe_ring_set_pinned(void* ring, int on) {
  return static_cast<hmoe::StagingRing*>(ring)->set_pinned(on != 0);
}

__attribute__((visibility("default"))) int hmoe_ring_bind_device(void* ring, uint64_t device_ptr, int slot) {
  auto* r = static_cast<hmoe::StagingRing*>(ring);
  if (slot < 0 || slot >= r->n_slots()) return fail("bind_device: slot " + std::to_string(slot) + " out of range");
  r->bind_device(static_cast<uintptr_t>(device_ptr), slot);
  return 0;
}
}

// ---- XLA FFI: hmoe_staging_wait(ring: i64 attr, slot: i32 attr) -> s64[2] (copy start, end ns).
// Lets a computation itself wait for its weights (the CUDA-event hand-off of the paper's
// loader -> compute workers); has_side_effect keeps XLA from dropping or hoisting it.
namespace ffi = xla::ffi;

namespace {
ffi::Error StagingWaitImpl(int64_t ring, int32_t slot, ffi::ResultBuffer<ffi::S64> times) {
  if (ring == 0) return ffi::Error::InvalidArgument("hmoe_staging_wait: attribute ring is a null handle");
  if (times->element_count() != 2)
    return ffi::Error::InvalidArgument("hmoe_staging_wait: result must be s64[2], got " +
                                       std::to_string(times->element_count()) + " elements");
  int64_t t0 = 0, t1 = 0;
  std::string err = reinterpret_cast<hmoe::StagingRing*>(ring)->wait(slot, &t0, &t1);
  if (!err.empty()) return ffi::Error::InvalidArgument("hmoe_staging_wait: " + err);
  times->typed_data()[0] = t0;
  times->typed_data()[1] = t1;
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HmoeStagingWait, StagingWaitImpl,
                              ffi::Ffi::Bind().Attr<int64_t>("ring").Attr<int32_t>("slot").Ret<ffi::Buffer<ffi::S64>>());
HMOE_FFI_TARGET("hmoe_staging_wait", HmoeStagingWait);

// ---- XLA FFI: hmoe_staging_put(ring: i64 attr, offsets: i64[] attr; N donated device slot
// buffers aliased to the N results). Copies host slot bytes [offsets[i], + size of buffer i)
// into buffer i IN PLACE: the device side of the ring is R fixed buffers allocated once, not a
// fresh allocation per group. The host slot is the one bound (hmoe_ring_bind_device) to the
// address of buffer 0, and it must be filled (ready). Two handlers: CPU (memcpy; on a CPU
// stand-in the engine aliases the slot instead, so this runs only when asked for) and CUDA
// (cuMemcpyHtoDAsync from the page-locked slot on XLA's stream: one DMA, no staging copy).
namespace {
struct PutCopy {
  void* dst;
  const uint8_t* src;
  size_t bytes;
};

// Validates the call and lists its copies (no XLA types below this function).
ffi::Error PlanPut(int64_t ring, ffi::Span<const int64_t> offsets, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, std::vector<PutCopy>* copies) {
  if (ring == 0) return ffi::Error::InvalidArgument("hmoe_staging_put: attribute ring is a null handle");
  if (rets.size() == 0 || rets.size() != args.size() || rets.size() != offsets.size())
    return ffi::Error::InvalidArgument("hmoe_staging_put: need N operands, N results and N offsets, got " +
                                       std::to_string(args.size()) + ", " + std::to_string(rets.size()) +
                                       ", " + std::to_string(offsets.size()));
  auto* r = reinterpret_cast<hmoe::StagingRing*>(ring);
  for (size_t i = 0; i < rets.size(); ++i) {
    auto out = rets.get<ffi::AnyBuffer>(i);
    auto in = args.get<ffi::AnyBuffer>(i);
    if (!out.has_value() || !in.has_value())
      return ffi::Error::InvalidArgument("hmoe_staging_put: operand/result " + std::to_string(i) + " is not a buffer");
    void* dst = (*out)->untyped_data();
    if (dst != in->untyped_data())
      return ffi::Error::InvalidArgument("hmoe_staging_put: result " + std::to_string(i) +
                                         " is not aliased to its operand (donate the device slot buffers)");
    copies->push_back({dst, nullptr, (*out)->size_bytes()});
  }
  int slot = r->bound_slot(reinterpret_cast<uintptr_t>(copies->front().dst));
  if (slot < 0)
    return ffi::Error::InvalidArgument(
        "hmoe_staging_put: device buffer 0 is not bound to a ring slot (it was reallocated: not in place)");
  if (r->state(slot) != int(hmoe::SlotState::kReady))
    return ffi::Error::InvalidArgument("hmoe_staging_put: host slot " + std::to_string(slot) + " is not filled");
  for (size_t i = 0; i < copies->size(); ++i) {
    auto& c = (*copies)[i];
    if (offsets[i] < 0 || size_t(offsets[i]) + c.bytes > r->slot_bytes())
      return ffi::Error::InvalidArgument("hmoe_staging_put: field " + std::to_string(i) + " [" +
                                         std::to_string(offsets[i]) + ", +" + std::to_string(c.bytes) +
                                         ") exceeds slot_bytes " + std::to_string(r->slot_bytes()));
    c.src = r->slot_ptr(slot) + offsets[i];
  }
  return ffi::Error::Success();
}

ffi::Error StagingPutCpuImpl(int64_t ring, ffi::Span<const int64_t> offsets, ffi::RemainingArgs args,
                             ffi::RemainingRets rets) {
  std::vector<PutCopy> copies;
  if (auto err = PlanPut(ring, offsets, args, rets, &copies); err.failure()) return err;
  for (const auto& c : copies) std::memcpy(c.dst, c.src, c.bytes);
  return ffi::Error::Success();
}

// CUDA driver API, resolved at run time (this extension links no CUDA library): libcuda is
// the one driver instance every CUDA user in the process shares, so XLA's stream and context
// are valid here. Untested on this project's machines (no GPU).
struct CudaDriver {
  using Fn_GetCtx = int (*)(void*, void**);
  using Fn_Push = int (*)(void*);
  using Fn_Pop = int (*)(void**);
  using Fn_Copy = int (*)(unsigned long long, const void*, size_t, void*);
  Fn_GetCtx stream_get_ctx = nullptr;
  Fn_Push ctx_push = nullptr;
  Fn_Pop ctx_pop = nullptr;
  Fn_Copy memcpy_htod_async = nullptr;
  bool ok() const { return stream_get_ctx && ctx_push && ctx_pop && memcpy_htod_async; }
};

const CudaDriver& cuda_driver() {
  static const CudaDriver d = [] {
    CudaDriver d;
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!h) h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return d;
    d.stream_get_ctx = reinterpret_cast<CudaDriver::Fn_GetCtx>(dlsym(h, "cuStreamGetCtx"));
    d.ctx_push = reinterpret_cast<CudaDriver::Fn_Push>(dlsym(h, "cuCtxPushCurrent_v2"));
    d.ctx_pop = reinterpret_cast<CudaDriver::Fn_Pop>(dlsym(h, "cuCtxPopCurrent_v2"));
    d.memcpy_htod_async = reinterpret_cast<CudaDriver::Fn_Copy>(dlsym(h, "cuMemcpyHtoDAsync_v2"));
    return d;
  }();
  return d;
}

ffi::Error StagingPutCudaImpl(void* stream, int64_t ring, ffi::Span<const int64_t> offsets,
                              ffi::RemainingArgs args, ffi::RemainingRets rets) {
  std::vector<PutCopy> copies;
  if (auto err = PlanPut(ring, offsets, args, rets, &copies); err.failure()) return err;
  const CudaDriver& cu = cuda_driver();
  if (!cu.ok()) return ffi::Error::Internal("hmoe_staging_put (CUDA): libcuda.so.1 or its symbols not found");
  void* ctx = nullptr;
  if (int rc = cu.stream_get_ctx(stream, &ctx); rc != 0)
    return ffi::Error::Internal("hmoe_staging_put (CUDA): cuStreamGetCtx failed: " + std::to_string(rc));
  cu.ctx_push(ctx);
  int rc = 0;
  for (const auto& c : copies) {
    // Enqueued on XLA's stream: ordered after earlier work on these buffers and before any
    // reader of the results; the source slot stays untouched until the executor has seen
    // this op's results ready (the loader blocks), so the DMA never reads a refilled slot.
    rc = cu.memcpy_htod_async(reinterpret_cast<unsigned long long>(c.dst), c.src, c.bytes, stream);
    if (rc != 0) break;
  }
  void* popped = nullptr;
  cu.ctx_pop(&popped);
  if (rc != 0) return ffi::Error::Internal("hmoe_staging_put (CUDA): cuMemcpyHtoDAsync failed: " + std::to_string(rc));
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HmoeStagingPut, StagingPutCpuImpl,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("ring")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .RemainingArgs()
                                  .RemainingRets());
HMOE_FFI_TARGET("hmoe_staging_put", HmoeStagingPut);

// Registered by runtime/staging.py under the name hmoe_staging_put for platform CUDA.
XLA_FFI_DEFINE_HANDLER_SYMBOL(HmoeStagingPutCuda, StagingPutCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Attr<int64_t>("ring")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .RemainingArgs()
                                  .RemainingRets());
HMOE_FFI_TARGET("hmoe_staging_put_cuda", HmoeStagingPutCuda);
