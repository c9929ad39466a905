"""Keep freed host memory in the process's heap, so a buffer freed after one prefill is
reused by the next instead of being handed back to the kernel and faulted in again.

Why: on the XLA CPU backend (the stand-in accelerators, and the host's own buffers) every
staged expert slab, every dequantised copy and every large temporary is a fresh malloc of
tens of MB. glibc serves those with mmap and returns them with munmap on free, so each
prefill first-touches all of them again, 4 KiB at a time (this machine's THP setting is
`madvise`: anonymous memory gets huge pages only when asked for). Measured here (AMD EPYC
Zen 3 VM, 2 cores, the e06 bench twin, a 128-token slp prefill on 2 stand-ins, repeated in
one process): 2.85 M minor page faults and 9.6 s of kernel time per prefill (a third of its
CPU time), 15.4-16.4 s wall; with this setting, 6-16 faults, 0.1 s of kernel time, 9.8-10.8 s.
The kernel's share also varied with the hypervisor's state, which made the stand-ins' slp
times drift by up to 1.5x between minutes of one run while the probes beside them did not
move (e06, 2026-12-07: the same P/D prefill 20.1 s, then 12.9 s).

How: glibc's mallopt, before the backend's threads allocate: no mmap for large chunks
(M_MMAP_MAX 0), never trim the heap top back (M_TRIM_THRESHOLD at its maximum), one arena
(M_ARENA_MAX 1: a thread arena cannot grow past 64 MiB and falls back to mmap for larger
chunks whatever M_MMAP_MAX says). The cost: the process keeps its peak host footprint
(freed blocks stay resident for reuse), as a GPU allocator's pool keeps its device memory.

Processes that serve or measure call it at start (the `hmoe` command line, the P/D workers,
the experiments); library callers and the test suite keep the allocator's defaults.
HMOE_HOST_HEAP=release turns it off (an ablation: the old behaviour)."""

from __future__ import annotations

import ctypes
import os
import sys

# glibc's malloc.h parameter numbers
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

ENV = "HMOE_HOST_HEAP"
_applied: str | None = None  # what retain_freed_host_memory did in this process


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()  # absent on musl and other C libraries
        return libc
    except (OSError, AttributeError):
        return None


def retain_freed_host_memory() -> str:
    """Set the heap to keep and reuse freed memory (see the module docstring). Idempotent.
    Returns what happened: "retained", "released" (HMOE_HOST_HEAP=release), or
    "unsupported" (not glibc: nothing changes)."""
    global _applied
    if _applied is not None:
        return _applied
    if os.environ.get(ENV, "retain").strip().lower() == "release":
        _applied = "released"
        return _applied
    libc = _glibc()
    if libc is None:
        _applied = "unsupported"
        return _applied
    ok = all(
        libc.mallopt(param, value) == 1
        for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_ARENA_MAX, 1))
    )
    _applied = "retained" if ok else "unsupported"
    return _applied


def host_heap_state() -> str:
    """What retain_freed_host_memory did in this process ("default" if it was not called):
    records name it beside their timings."""
    return _applied or "default"
