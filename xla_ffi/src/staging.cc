// StagingRing implementation (bound to Python as _hmoe_ffi.StagingRing in staging_bind.cc)
// and the XLA FFI targets hmoe_staging_wait (block inside a computation until a slot is
// filled) and hmoe_staging_put (the in-place device side; its CUDA half is staging_cuda.cc).
#include "staging.h"

#include <dlfcn.h>
#include <time.h>

#include <algorithm>
#include <climits>
#include <cstdint>
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
      copier_(&real_cuda_driver(), n_slots),
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
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (slots_[slot] != SlotState::kReady) return "release: slot " + std::to_string(slot) + " is not ready";
    slots_[slot] = SlotState::kFree;
  }
  if (auto err = copier_.released(slot); !err.empty()) return "release: " + err;
  return "";
}

std::string StagingRing::wait_device(int slot, uint64_t generation, int64_t timeout_ns, bool* done) {
  auto err = copier_.wait_copied(slot, generation, timeout_ns, done);
  return err.empty() ? "" : "wait_device: " + err;
}

std::string StagingRing::create(int n_slots, size_t slot_bytes, int n_threads, double rate_bytes_per_s,
                                std::unique_ptr<StagingRing>* out) {
  if (n_slots < 1 || slot_bytes == 0 || n_threads < 1)
    return "create: need n_slots >= 1, slot_bytes > 0, copy_threads >= 1; got n_slots=" + std::to_string(n_slots) +
           ", slot_bytes=" + std::to_string(slot_bytes) + ", copy_threads=" + std::to_string(n_threads);
  if (rate_bytes_per_s < 0) return "create: rate must be >= 0 (0: no cap), got " + std::to_string(rate_bytes_per_s);
  auto r = std::make_unique<StagingRing>(n_slots, slot_bytes, n_threads, rate_bytes_per_s);
  if (!r->slot_ptr(0))
    return "create: could not allocate " + std::to_string(size_t(n_slots) * slot_bytes) + " bytes";
  *out = std::move(r);
  return "";
}

double memcpy_gbps(size_t bytes, int reps) {
  bytes = std::max<size_t>(bytes, kAlign);
  auto* src = static_cast<uint8_t*>(std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign));
  auto* dst = static_cast<uint8_t*>(std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign));
  if (!src || !dst) {
    std::free(src);
    std::free(dst);
    return 0.0;
  }
  std::memset(src, 1, bytes);  // touch every page of both, outside the timed copies
  std::memset(dst, 0, bytes);
  int64_t best = INT64_MAX;
  for (int i = 0; i < std::max(reps, 1); ++i) {
    int64_t t0 = monotonic_ns();
    std::memcpy(dst, src, bytes);
    best = std::min(best, monotonic_ns() - t0);
  }
  volatile uint8_t sink = dst[bytes - 1];  // the copies are observable
  (void)sink;
  std::free(src);
  std::free(dst);
  return double(bytes) / double(std::max<int64_t>(best, 1));  // bytes per ns = GB/s
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
// (cuMemcpyHtoDAsync from the page-locked slot on the ring's own copy stream, ordered by
// events, never on XLA's compute stream: staging_cuda.h).
namespace {
using hmoe::PutCopy;

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
        "hmoe_staging_put: device buffer 0 is not bound to a ring slot (it was reallocated: not in place; "
        "a donation XLA refused, e.g. a host view of the buffer is alive, gives a fresh copy)");
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

// The GPU half: the DMAs go on the ring's copy stream, ordered by events (staging_cuda.h has
// the ordering argument); the loader then waits for them (StagingRing.wait_device) before its
// load op completes. Untested on a GPU here (none was lent); the choreography is unit-tested
// with a fake driver table (tests/test_runtime_staging.py).
ffi::Error StagingPutCudaImpl(void* stream, int64_t ring, ffi::Span<const int64_t> offsets,
                              ffi::RemainingArgs args, ffi::RemainingRets rets) {
  std::vector<PutCopy> copies;
  if (auto err = PlanPut(ring, offsets, args, rets, &copies); err.failure()) return err;
  const hmoe::CuDriver& cu = hmoe::real_cuda_driver();
  if (!cu.ok()) return ffi::Error::Internal("hmoe_staging_put (CUDA): driver API not found: " + cu.missing);
  auto* r = reinterpret_cast<hmoe::StagingRing*>(ring);
  int slot = r->bound_slot(reinterpret_cast<uintptr_t>(copies.front().dst));
  if (auto err = r->copier().put(stream, slot, copies); !err.empty())
    return ffi::Error::Internal("hmoe_staging_put (CUDA): " + err);
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
