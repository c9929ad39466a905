import os

# Stand-in accelerators: 4 extra XLA CPU devices, set before jax initialises a backend.
os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_enable_x64", False)
