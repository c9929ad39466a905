import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Stand-in accelerators: 4 extra XLA CPU devices, set before jax initialises a backend.
os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_enable_x64", False)

# load_checkpoint converts every safetensors directory it is given into a weight arena under
# $HMOE_ARENA_DIR (hmoe_jax.io.cache); tests load many tmp_path checkpoints, so their arenas
# go to one directory per session (inherited by CLI subprocesses), not the user's cache.
if "HMOE_ARENA_DIR" not in os.environ:
    os.environ["HMOE_ARENA_DIR"] = tempfile.mkdtemp(prefix="hmoe-test-arenas-")
    atexit.register(shutil.rmtree, os.environ["HMOE_ARENA_DIR"], True)

ROOT = Path(__file__).resolve().parents[1]

# One persistent XLA compilation cache per session (and its CLI / server subprocesses, by
# the environment): a fresh Engine per test closes over new functions, so jax's in-memory
# caches miss, but most of those programs are byte-identical to one an earlier test
# compiled. Hitting the on-disk cache instead cut four engine/serve test files from 254 s
# to 204 s on 2 cores. A test that needs a cold cache (counting compiles) sets its own
# (`hmoe serve --compile-cache DIR|none`). HMOE_TEST_XLA_CACHE=none turns it off.
if (
    os.environ.get("HMOE_TEST_XLA_CACHE", "").lower() != "none"
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ
):
    from hmoe_jax.serve.http_server import configure_compile_cache  # `hmoe serve --compile-cache`'s

    _xla_cache = tempfile.mkdtemp(prefix="hmoe-test-xla-")
    atexit.register(shutil.rmtree, _xla_cache, True)
    configure_compile_cache(_xla_cache)  # every program kept; subprocesses inherit it by env

# Every XLA:CPU executable holds ~3 memory mappings (code, read-only data, data) and jax's
# jit caches keep every executable alive for the life of the process. The default lane
# compiles tens of thousands of programs (a fresh Engine per test closes over new
# functions), so one pytest process reached Linux's vm.max_map_count (65,530): LLVM's JIT
# then fails an mmap without checking and XLA segfaults inside the next compile (CI exit
# 139 at ~89%, in whichever test compiled next). Three engine test files alone left
# 19,691 mappings; releasing the caches after each module keeps it under ~2,000.
MAX_MAPS_WARN = 40_000


def _mapping_count() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


@pytest.fixture
def no_persistent_compile_cache():
    """For a test that counts backend compiles: the session's on-disk cache would turn them
    into cache hits (jax memoises whether the cache is in use, hence reset_cache)."""
    from jax._src import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    yield
    gc.collect()
    jax.clear_caches()
    gc.collect()
    n = _mapping_count()
    if n is not None and n > MAX_MAPS_WARN:  # fail loudly here, not as a segfault later
        pytest.fail(
            f"{request.module.__name__} left {n} memory mappings after jax.clear_caches() "
            f"(Linux stops at vm.max_map_count, 65,530 by default): something keeps compiled "
            f"executables or mapped arenas alive across tests",
            pytrace=False,
        )


# a profile `hmoe calibrate` wrote on THIS machine (skips the calibration in the run)
TIMING_PROFILE_ENV = "HMOE_TIMING_PROFILE"


@pytest.fixture(scope="session")
def calibrated_profile(tmp_path_factory):
    """This machine's simulator profile for the `timing` lane, measured in this run by
    `hmoe calibrate --quick` (~1-2 min; in a fresh process: it sets up its own stand-in
    devices before jax starts), or the file $HMOE_TIMING_PROFILE names. Never the committed
    configs/systems/local.toml: that is one particular machine's, and a timing check
    against another machine's rates tests nothing but the difference between machines."""
    from hmoe_jax.plan.profile import load_profile

    given = os.environ.get(TIMING_PROFILE_ENV)
    if given:
        return load_profile(given)
    out = tmp_path_factory.mktemp("calibrate") / "local.toml"
    cmd = [sys.executable, "-m", "hmoe_jax.cli", "calibrate", "--quick", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        pytest.fail(f"hmoe calibrate --quick failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return load_profile(str(out))
