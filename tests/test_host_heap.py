"""runtime/host_heap.py: after retain_freed_host_memory, a large block freed and allocated
again (on another thread, as XLA's CPU threads do) is reused without page faults; without it
(or with HMOE_HOST_HEAP=release) every reuse faults its pages in again. Each case runs in a
fresh interpreter: the setting is process-wide and must precede the threads' allocations."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hmoe_jax.runtime.host_heap import _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt only")

BLOCK_BYTES = 64 << 20  # over a thread arena's 64 MiB heap with its header: the mmap path

SNIPPET = r"""
import ctypes, json, resource, sys, threading
from hmoe_jax.runtime.host_heap import retain_freed_host_memory, host_heap_state
if sys.argv[1] == "call":
    retain_freed_host_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = int(sys.argv[2])
faults = []

def cycle():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)  # touch every page
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

for _ in range(3):
    t = threading.Thread(target=cycle)
    t.start()
    t.join()
print(json.dumps({"state": host_heap_state(), "faults": faults}))
"""


def _run(call: bool, env_value: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("HMOE_HOST_HEAP", None)
    if env_value is not None:
        env["HMOE_HOST_HEAP"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", SNIPPET, "call" if call else "skip", str(BLOCK_BYTES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_block_is_reused_without_faults():
    pages = BLOCK_BYTES // os.sysconf("SC_PAGE_SIZE")
    base = _run(call=False)
    assert base["state"] == "default"
    # the allocator's default: every cycle maps fresh memory and faults it in again
    assert min(base["faults"]) > pages // 2, base
    kept = _run(call=True)
    assert kept["state"] == "retained"
    assert kept["faults"][0] > pages // 2, kept  # the first touch is real either way
    assert max(kept["faults"][1:]) < pages // 100, kept  # later cycles reuse the resident block


def test_release_env_keeps_the_default():
    pages = BLOCK_BYTES // os.sysconf("SC_PAGE_SIZE")
    out = _run(call=True, env_value="release")
    assert out["state"] == "released"
    assert min(out["faults"]) > pages // 2, out
