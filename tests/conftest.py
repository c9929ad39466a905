import atexit
import os
import shutil
import tempfile

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
