// Host-side staging ring for stream-loading prefill (SLP): an aligned arena of R slots and
// background copy threads that fill a slot from the host weight arena (memcpy, optionally
// rate-capped to emulate a host->accelerator link) and signal readiness. Slots are reused;
// nothing is allocated after construction.
//
// Slot life cycle: kFree --fill()--> kFilling --(copy threads)--> kReady --release()--> kFree.
// fill() on a slot that is not free is an error (the schedule must release it first):
// that is what guarantees a slot is never overwritten while a computation reads it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "staging_cuda.h"

namespace hmoe {

struct CopySegment {
  const uint8_t* src;
  size_t dst_offset;  // inside the slot
  size_t bytes;
};

enum class SlotState : int { kFree = 0, kFilling = 1, kReady = 2 };

class StagingRing {
 public:
  // rate_bytes_per_s <= 0: no cap. n_threads >= 1 copy threads share each fill.
  StagingRing(int n_slots, size_t slot_bytes, int n_threads, double rate_bytes_per_s);
  // Validates the arguments and the allocation; returns "" or an error naming the problem.
  static std::string create(int n_slots, size_t slot_bytes, int n_threads, double rate_bytes_per_s,
                            std::unique_ptr<StagingRing>* out);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  int n_slots() const { return static_cast<int>(slots_.size()); }
  size_t slot_bytes() const { return slot_bytes_; }
  int copy_threads() const { return static_cast<int>(helpers_.size()) + 1; }
  uint8_t* slot_ptr(int slot) const { return arena_ + static_cast<size_t>(slot) * slot_bytes_; }
  bool pinned() const { return pinned_; }
  // Page-lock (cudaHostRegister) or unlock the arena; returns the resulting state. A GPU
  // engine unlocks it to hand the registration to XLA instead (Client.dma_map).
  bool set_pinned(bool on);

  // Queue a fill; returns "" or an error message naming the problem.
  std::string fill(int slot, std::vector<CopySegment> segments);
  // Block until `slot` is ready; returns its copy start/end (CLOCK_MONOTONIC ns).
  std::string wait(int slot, int64_t* start_ns, int64_t* end_ns);
  // Frees the slot for the next fill; with a GPU copier, also records the slot's freed event on
  // XLA's stream (staging_cuda.h: the next DMA into the slot's device buffers waits for it).
  std::string release(int slot);
  int state(int slot);

  // Device ring: a preallocated accelerator-side slot buffer, known by the address of its
  // first field, is bound to host slot `slot` (hmoe_staging_put finds its source that way;
  // an address that is not bound means the buffer was reallocated, i.e. not updated in place).
  void bind_device(uintptr_t device_ptr, int slot);
  int bound_slot(uintptr_t device_ptr);  // -1 if not bound

  // The GPU side (libcuda's driver table; no driver call before the first CUDA put).
  DeviceCopier& copier() { return copier_; }
  // DeviceCopier::wait_copied for this ring's slots.
  std::string wait_device(int slot, uint64_t generation, int64_t timeout_ns, bool* done);

  uint64_t bytes_copied() const { return bytes_copied_.load(); }
  uint64_t fills_done() const { return fills_done_.load(); }

 private:
  struct Job {
    int slot;
    std::vector<CopySegment> segments;
    int64_t enqueue_ns;
  };
  void link_loop();
  void helper_loop();
  void copy_job(const Job& job);
  void copy_chunks();

  std::vector<SlotState> slots_;
  std::vector<int64_t> start_ns_, end_ns_;
  DeviceCopier copier_;
  size_t slot_bytes_;
  uint8_t* arena_ = nullptr;
  bool pinned_ = false;
  double rate_;

  std::mutex mu_;
  std::condition_variable cv_jobs_, cv_ready_;
  std::deque<Job> jobs_;
  std::unordered_map<uintptr_t, int> bound_;  // device slot buffer -> host slot
  bool stop_ = false;
  std::thread link_;

  // The fill being copied: chunked so helper threads can share it.
  std::mutex work_mu_;
  std::condition_variable cv_work_, cv_work_done_;
  const Job* current_ = nullptr;
  uint64_t generation_ = 0;
  std::atomic<size_t> next_chunk_{0};
  std::atomic<size_t> paced_bytes_{0};
  int busy_helpers_ = 0;
  // Rate cap: the emulated link is a FIFO server. A fill queued while the link is busy is
  // paced from the previous fill's due time (so the link's throughput is the cap even when a
  // copy thread wakes late), one queued while it is idle from when its copy starts.
  int64_t job_start_ns_ = 0;
  int64_t link_due_ns_ = 0;
  std::vector<std::pair<size_t, size_t>> chunks_;  // (segment index, offset within it)
  std::vector<std::thread> helpers_;

  std::atomic<uint64_t> bytes_copied_{0};
  std::atomic<uint64_t> fills_done_{0};
};

int64_t monotonic_ns();

// One thread's memcpy rate in GB/s: the best of `reps` copies of `bytes` (buffers touched
// first). What StagingRing's copy threads are sized from (runtime/staging.py).
double memcpy_gbps(size_t bytes, int reps);

}  // namespace hmoe
