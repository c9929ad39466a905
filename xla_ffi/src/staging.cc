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
  jobs_.push_back(Job{slot, std::move(segments)});
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
    job_start_ns_ = monotonic_ns();
    ++generation_;
  }
  cv_work_.notify_all();
  copy_chunks();  // the link thread copies too
  std::unique_lock<std::mutex> lk(work_mu_);
  current_ = nullptr;  // helpers that wake late find no work
  cv_work_done_.wait(lk, [&] { return busy_helpers_ == 0; });
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

__attribute__((visibility("default"))) int64_t hmoe_monotonic_ns() { return hmoe::monotonic_ns(); }
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
