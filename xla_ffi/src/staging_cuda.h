// The GPU side of the staging ring's `inplace` device mode: host->device DMAs on a copy stream
// of our own, ordered against XLA's compute stream by CUDA events, never on the compute stream.
//
// Why not the compute stream: cuMemcpyHtoDAsync on XLA's stream runs after every kernel XLA
// enqueued before it and before every kernel after it, so the copy of group g+1 never overlaps
// the expert GEMMs of group g.
//
// Why not "copy stream waits all of XLA's pending work, compute stream waits the copy at the
// put": that pair gives NO overlap at all. The copy would wait for everything enqueued on the
// compute stream before the put, and the compute stream would wait for the copy before
// everything enqueued after the put, so nothing on the compute stream ever runs during the DMA.
// Each side has to be narrowed to the one hazard it guards:
//
//  * write-after-read (the copy must not overwrite a device slot its previous group's GEMMs
//    still read): the copy stream waits `freed[slot]`, an event recorded on XLA's compute
//    stream when the ring releases the slot (ops.unload, whose deps are the slot's last
//    readers: already launched, in pipelined/serial mode already finished). Work launched
//    after that release, e.g. the GEMMs of group g while group g+1 is copied into another slot,
//    is not waited for.
//  * read-after-write (a consumer must not read the slot before the DMA landed): the loader
//    thread blocks on `copied[slot]` (cuEventSynchronize, GIL released) before the load op
//    completes, and the executor launches a consumer only after its load op completed. The
//    compute stream itself never waits on the copy stream, so where the put sits in XLA's
//    stream order does not matter (before or after the GEMMs of group g). XLA may launch the
//    put's executable after jit returns (async dispatch), so the loader first waits until the
//    put of the generation it dispatched has been issued (a per-slot count), then for its DMA.
//
// So the DMA of group g+1 runs on the copy engine while the compute stream runs group g's GEMMs,
// with ring size R >= 2 (the slot being refilled is not the one being read).
//
// The driver API is resolved at run time (dlsym on libcuda.so.1): the extension links no CUDA
// library and loads on machines without one. `CuDriver` is a plain table of function pointers so
// that the choreography can be unit-tested with a fake table on a CPU-only machine.
#pragma once

#include <cstddef>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace hmoe {

struct CuDriver {
  // CUresult fn(...) with CUstream/CUevent/CUcontext as void*.
  int (*stream_get_ctx)(void* stream, void** ctx) = nullptr;
  int (*ctx_push)(void* ctx) = nullptr;
  int (*ctx_pop)(void** ctx) = nullptr;
  int (*stream_create)(void** stream, unsigned flags) = nullptr;
  int (*event_create)(void** event, unsigned flags) = nullptr;
  int (*event_record)(void* event, void* stream) = nullptr;
  int (*stream_wait_event)(void* stream, void* event, unsigned flags) = nullptr;
  int (*event_synchronize)(void* event) = nullptr;
  int (*memcpy_htod_async)(unsigned long long dst, const void* src, size_t bytes, void* stream) = nullptr;
  int (*event_destroy)(void* event) = nullptr;
  int (*stream_destroy)(void* stream) = nullptr;
  std::string missing;  // "" or what could not be resolved
  bool ok() const { return missing.empty(); }
};

// libcuda.so.1's table (resolved once); `missing` says what was not found.
const CuDriver& real_cuda_driver();

struct PutCopy {
  void* dst;
  const uint8_t* src;
  size_t bytes;
};

// Per staging ring: the events of its slots and the copy stream of each CUDA context it was
// used in (one stream per ring and context, created on first use; destroyed with the ring,
// when the driver may already be shutting down: their errors are ignored then).
class DeviceCopier {
 public:
  DeviceCopier(const CuDriver* cu, int n_slots);
  ~DeviceCopier();
  DeviceCopier(const DeviceCopier&) = delete;
  DeviceCopier& operator=(const DeviceCopier&) = delete;

  // Enqueue `copies` for `slot` on the copy stream of xla_stream's context, after the slot's
  // freed event (if the slot was used and released before), and record its copied event.
  // Remembers xla_stream for the slot (released()). Returns "" or an error naming the failing call.
  std::string put(void* xla_stream, int slot, const std::vector<PutCopy>& copies);
  // The ring released `slot`: record its freed event on the XLA stream of its last put()
  // (nothing before the first put: the slot's device buffers were never read yet).
  std::string released(int slot);
  // Block the calling thread until the slot's put number `generation` (1, 2, ... per slot)
  // was issued and its DMA landed; gives up after timeout_ns if the put was not issued by then
  // (*done = false: the caller checks whether XLA failed the put instead).
  std::string wait_copied(int slot, uint64_t generation, int64_t timeout_ns, bool* done);

 private:
  struct Slot {
    void* copied = nullptr;
    void* freed = nullptr;
    bool copy_pending = false;
    bool freed_recorded = false;
    bool used = false;
    uint64_t issued = 0;  // puts issued so far
    void* ctx = nullptr;  // the CUDA context of the device the slot was copied to
    void* xla_stream = nullptr;  // that device's XLA stream (the slot's readers run there)
  };
  std::string call(int rc, const char* what);
  std::string ensure_events(Slot& s);

  const CuDriver* cu_;
  std::mutex mu_;
  std::condition_variable cv_issued_;
  std::vector<Slot> slots_;
  std::unordered_map<void*, void*> copy_stream_;  // context -> our copy stream
};

}  // namespace hmoe
