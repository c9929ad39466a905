// Python binding of the staging ring: _hmoe_ffi.StagingRing (runtime/staging.py wraps it).
// Errors raise StagingRingError (a RuntimeError) with the C++ message; the calls that block
// (wait, wait_device, and fill, which may wait for the queue lock) release the GIL, so a
// Python loader thread waiting on a copy does not stall the compute thread.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "staging.h"

namespace nb = nanobind;

namespace hmoe {
namespace {

struct RingError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check(const std::string& err) {
  if (!err.empty()) throw RingError(err);
}

// Owns the ring; close() destroys it early (joins the copy threads, frees the arena) so a
// Python object that outlives close() answers every call with a clear error.
class PyRing {
 public:
  PyRing(int n_slots, uint64_t slot_bytes, int copy_threads, double rate_bytes_per_s) {
    check(StagingRing::create(n_slots, slot_bytes, copy_threads, rate_bytes_per_s, &ring_));
  }
  StagingRing& get() const {
    if (!ring_) throw RingError("the staging ring is closed");
    return *ring_;
  }
  void close() { ring_.reset(); }
  bool closed() const { return !ring_; }

 private:
  std::unique_ptr<StagingRing> ring_;
};

// A fake CUDA driver that logs each call, for testing DeviceCopier's choreography on a CPU:
// handles are small integers ("s1", "e2"), XLA's stream is "xla", its context "ctx".
std::vector<std::string> g_log;
int g_next_handle = 0;
std::string name_of(void* h) {
  auto v = reinterpret_cast<uintptr_t>(h);
  if (v == 0x1000) return "xla";
  if (v == 0x2000) return "ctx";
  return (v >= 0x100 ? "e" : "s") + std::to_string(v & 0xff);
}
CuDriver fake_driver() {
  CuDriver d;
  d.stream_get_ctx = [](void* s, void** ctx) {
    g_log.push_back("cuStreamGetCtx " + name_of(s));
    *ctx = reinterpret_cast<void*>(0x2000);
    return 0;
  };
  d.ctx_push = [](void* c) {
    g_log.push_back("cuCtxPushCurrent " + name_of(c));
    return 0;
  };
  d.ctx_pop = [](void** c) {
    g_log.push_back("cuCtxPopCurrent");
    *c = reinterpret_cast<void*>(0x2000);
    return 0;
  };
  d.stream_create = [](void** s, unsigned flags) {
    *s = reinterpret_cast<void*>(uintptr_t(++g_next_handle));
    g_log.push_back("cuStreamCreate " + name_of(*s) + " flags=" + std::to_string(flags));
    return 0;
  };
  d.event_create = [](void** e, unsigned flags) {
    *e = reinterpret_cast<void*>(uintptr_t(0x100 + ++g_next_handle));
    g_log.push_back("cuEventCreate " + name_of(*e) + " flags=" + std::to_string(flags));
    return 0;
  };
  d.event_record = [](void* e, void* s) {
    g_log.push_back("cuEventRecord " + name_of(e) + " on " + name_of(s));
    return 0;
  };
  d.stream_wait_event = [](void* s, void* e, unsigned) {
    g_log.push_back("cuStreamWaitEvent " + name_of(s) + " waits " + name_of(e));
    return 0;
  };
  d.event_synchronize = [](void* e) {
    g_log.push_back("cuEventSynchronize " + name_of(e));
    return 0;
  };
  d.memcpy_htod_async = [](unsigned long long dst, const void*, size_t bytes, void* s) {
    g_log.push_back("cuMemcpyHtoDAsync dst=" + std::to_string(dst) + " bytes=" + std::to_string(bytes) + " on " +
                    name_of(s));
    return 0;
  };
  d.event_destroy = [](void* e) {
    g_log.push_back("cuEventDestroy " + name_of(e));
    return 0;
  };
  d.stream_destroy = [](void* s) {
    g_log.push_back("cuStreamDestroy " + name_of(s));
    return 0;
  };
  return d;
}

// Runs a script of ("put", slot) / ("release", slot) / ("wait", slot) steps against a fresh
// DeviceCopier of n_slots on the fake driver ("wait" waits for the slot's latest put, without
// blocking); returns the driver calls, one string each (a failing step appends "error: ...",
// a wait whose put was not issued "not issued").
std::vector<std::string> fake_choreography(int n_slots, const std::vector<std::tuple<std::string, int>>& steps) {
  static const CuDriver fake = fake_driver();
  g_log.clear();
  g_next_handle = 0;
  auto copier = std::make_unique<DeviceCopier>(&fake, n_slots);
  DeviceCopier& c = *copier;
  void* xla = reinterpret_cast<void*>(0x1000);
  std::vector<uint64_t> puts(std::max(n_slots, 0), 0);
  for (const auto& [what, slot] : steps) {
    if (slot < 0 || slot >= n_slots) throw RingError("fake_choreography: slot " + std::to_string(slot) + " out of range");
    std::string err;
    g_log.push_back("# " + what + " " + std::to_string(slot));
    if (what == "put") {
      std::vector<PutCopy> copies = {{reinterpret_cast<void*>(uintptr_t(1000 + 10 * slot)), nullptr, 64},
                                     {reinterpret_cast<void*>(uintptr_t(1001 + 10 * slot)), nullptr, 8}};
      err = c.put(xla, slot, copies);
      if (err.empty()) ++puts[slot];
    } else if (what == "release") {
      err = c.released(slot);
    } else if (what == "wait") {
      bool done = false;
      err = c.wait_copied(slot, puts[slot] ? puts[slot] : 1, 0, &done);
      if (err.empty() && !done) g_log.push_back("not issued");
    } else {
      throw RingError("fake_choreography: unknown step " + what);
    }
    if (!err.empty()) g_log.push_back("error: " + err);
  }
  g_log.push_back("# close");
  copier.reset();
  return g_log;
}

}  // namespace

void bind_staging(nb::module_& m) {
  nb::exception<RingError>(m, "StagingRingError", PyExc_RuntimeError);
  nb::class_<PyRing>(m, "StagingRing",
                     "R page-aligned (pinned where cudart exists) host slots filled by C++ copy threads; "
                     "see runtime/staging.py")
      .def(nb::init<int, uint64_t, int, double>(), nb::arg("n_slots"), nb::arg("slot_bytes"),
           nb::arg("copy_threads"), nb::arg("rate_bytes_per_s") = 0.0)
      .def_prop_ro("handle", [](const PyRing& r) { return reinterpret_cast<uintptr_t>(&r.get()); },
                   "the ring's address: the `ring` attribute of the FFI targets")
      .def_prop_ro("n_slots", [](const PyRing& r) { return r.get().n_slots(); })
      .def_prop_ro("slot_bytes", [](const PyRing& r) { return uint64_t(r.get().slot_bytes()); })
      .def_prop_ro("copy_threads", [](const PyRing& r) { return r.get().copy_threads(); })
      .def_prop_ro("pinned", [](const PyRing& r) { return r.get().pinned(); })
      .def_prop_ro("bytes_copied", [](const PyRing& r) { return r.get().bytes_copied(); })
      .def_prop_ro("fills_done", [](const PyRing& r) { return r.get().fills_done(); })
      .def_prop_ro("closed", &PyRing::closed)
      .def("set_pinned", [](PyRing& r, bool on) { return r.get().set_pinned(on); })
      .def("slot_ptr",
           [](const PyRing& r, int slot) {
             StagingRing& g = r.get();
             if (slot < 0 || slot >= g.n_slots())
               throw RingError("slot_ptr: slot " + std::to_string(slot) + " out of range [0, " +
                               std::to_string(g.n_slots()) + ")");
             return reinterpret_cast<uintptr_t>(g.slot_ptr(slot));
           })
      .def(
          "fill",
          [](PyRing& r, int slot, const std::vector<std::tuple<uintptr_t, uint64_t, uint64_t>>& segments) {
            std::vector<CopySegment> segs;
            segs.reserve(segments.size());
            for (const auto& [src, dst, n] : segments)
              segs.push_back({reinterpret_cast<const uint8_t*>(src), size_t(dst), size_t(n)});
            StagingRing& g = r.get();
            std::string err;
            {
              nb::gil_scoped_release nogil;
              err = g.fill(slot, std::move(segs));
            }
            check(err);
          },
          nb::arg("slot"), nb::arg("segments"), "segments: (source address, offset in the slot, bytes)")
      .def(
          "wait",
          [](PyRing& r, int slot) {
            StagingRing& g = r.get();
            int64_t t0 = 0, t1 = 0;
            std::string err;
            {
              nb::gil_scoped_release nogil;
              err = g.wait(slot, &t0, &t1);
            }
            check(err);
            return std::make_tuple(t0, t1);
          },
          nb::arg("slot"), "block (GIL released) until the slot is filled; the copy's (start_ns, end_ns)")
      .def(
          "wait_device",
          [](PyRing& r, int slot, uint64_t generation, double timeout_s) {
            StagingRing& g = r.get();
            std::string err;
            bool done = false;
            {
              nb::gil_scoped_release nogil;
              err = g.wait_device(slot, generation, int64_t(timeout_s * 1e9), &done);
            }
            check(err);
            return done;
          },
          nb::arg("slot"), nb::arg("generation"), nb::arg("timeout_s"),
          "block (GIL released) until the slot's put number `generation` was issued and its DMA landed; "
          "False if it was not issued within timeout_s")
      .def("release", [](PyRing& r, int slot) { check(r.get().release(slot)); }, nb::arg("slot"))
      .def("state", [](PyRing& r, int slot) { return r.get().state(slot); }, nb::arg("slot"))
      .def(
          "bind_device",
          [](PyRing& r, uintptr_t device_ptr, int slot) {
            StagingRing& g = r.get();
            if (slot < 0 || slot >= g.n_slots())
              throw RingError("bind_device: slot " + std::to_string(slot) + " out of range");
            g.bind_device(device_ptr, slot);
          },
          nb::arg("device_ptr"), nb::arg("slot"))
      .def("close", &PyRing::close);
  m.def(
      "memcpy_gbps",
      [](uint64_t bytes, int reps) {
        nb::gil_scoped_release nogil;
        return memcpy_gbps(bytes, reps);
      },
      nb::arg("bytes"), nb::arg("reps") = 3, "one thread's memcpy rate (GB/s), best of reps");
  m.def("cuda_driver_missing", []() { return real_cuda_driver().missing; },
        "'' when libcuda.so.1 and every driver call the staging ring uses resolve, else what is missing");
  m.def("_fake_cuda_choreography", &fake_choreography, nb::arg("n_slots"), nb::arg("steps"),
        "test hook: DeviceCopier's driver calls for a script of put/release/wait steps, on a fake driver");
}

}  // namespace hmoe
