"""What a GPU run needs before and as JAX starts: the platforms the hybrid engine needs, a
refusal of a silent CPU fallback, and JAX's GPU memory fraction from the real card.

- check_platforms: the engine places weights from the host device and runs the routed
  experts there (the FFI kernels), so JAX's cpu backend must be up beside the GPU one.
  `JAX_PLATFORMS=cuda` hides it (jax.devices("cpu") raises): refused, naming `cuda,cpu`.
- check_gpu(required=True): a CUDA install JAX cannot load (wrong plugin, driver, no jax
  CUDA wheels) makes JAX fall back to CPU with only a warning, and the engine would then run
  on stand-in CPU devices; `--require-gpu` / Engine(require_gpu=True) refuses that.
- set_gpu_mem_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION from a plan's peak on the card this
  machine has (nvidia-smi; queried without starting JAX's backend). JAX reads the variable
  once, when its GPU backend starts, so this must run before the first jax call that touches
  a device (`hmoe generate` / `hmoe serve` call it first thing; the Engine calls it itself
  when the backend is not up yet, and warns when it is too late). A value the user set wins;
  no GPU (no nvidia-smi) -> nothing set.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping

from hmoe_jax.config import ModelConfig
from hmoe_jax.io.errors import InputError
from hmoe_jax.plan.memory import GIB, gpu_mem_fraction
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.schedules.registry import get_schedule

MEM_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# --system's card vs the real one: nvidia-smi reports usable MiB (a "32 GB" RTX 5090 shows
# 32,607 MiB = 31.8 GiB against a profile's 32 GiB), so a few percent is the same card.
CARD_MISMATCH_TOLERANCE = 0.05
NVIDIA_SMI_TIMEOUT_S = 10.0


class PlatformError(InputError):
    """JAX's platforms or devices cannot run the hybrid engine as asked (the command line
    prints the message on one line, as for any bad input)."""


def check_platforms(env: Mapping[str, str] | None = None) -> None:
    """Refuse a JAX_PLATFORMS without the cpu backend (env: os.environ by default). Unset or
    empty means JAX's default (every platform it finds, cpu included)."""
    env = os.environ if env is None else env
    value = env.get("JAX_PLATFORMS", "")
    names = [p.strip().lower() for p in value.split(",") if p.strip()]
    if names and "cpu" not in names:
        gpu = next((n for n in names if n in ("cuda", "gpu", "rocm")), "cuda")
        raise PlatformError(
            f"JAX_PLATFORMS={value} leaves out JAX's cpu backend, which the hybrid engine needs "
            "(weights are placed from the host device and the routed experts run there, through the "
            f"FFI kernels): set JAX_PLATFORMS={gpu},cpu, or unset it"
        )


def check_gpu(required: bool, devices: Callable[[str], list] | None = None) -> list:
    """The GPU devices JAX has (starts JAX's backend). required and none -> PlatformError:
    JAX fell back to CPU (it only warns), which `--require-gpu` refuses. `devices` is
    jax.devices (a parameter so tests can fake a device list)."""
    if devices is None:
        import jax

        devices = jax.devices
    try:
        gpus = list(devices("gpu"))
    except RuntimeError:  # no GPU backend at all
        gpus = []
    if required and not gpus:
        try:
            have = [str(d) for d in devices("cpu")]
        except RuntimeError:
            have = []
        raise PlatformError(
            f"--require-gpu: JAX found no GPU (its devices: {have}); a CUDA install JAX cannot load "
            "falls back to CPU with only a warning. Check `python -c 'import jax; print(jax.devices())'` "
            "and the warning it prints, the jax CUDA plugin (pip install '.[cuda13]' or '.[cuda12]', "
            "matching jax's version) and the NVIDIA driver (nvidia-smi)"
        )
    return gpus


def query_gpu_mem_bytes(
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    env: Mapping[str, str] | None = None,
) -> list[int] | None:
    """Total memory of each GPU this process may use, in bytes, from `nvidia-smi` (not from
    JAX: asking JAX would start its backend before the memory fraction is set). None when
    there is no nvidia-smi or it fails (no GPU: nothing to size). CUDA_VISIBLE_DEVICES as
    integer indices selects and orders the cards as CUDA will."""
    env = os.environ if env is None else env
    if run is subprocess.run and shutil.which("nvidia-smi") is None:
        return None
    try:
        out = run(
            ["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    mib: dict[int, int] = {}
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            mib[int(parts[0])] = int(float(parts[1]))
        except ValueError:
            continue
    if not mib:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    order = sorted(mib)
    if visible is not None and all(v.strip().isdigit() for v in visible.split(",") if v.strip()):
        order = [int(v) for v in visible.split(",") if v.strip() and int(v) in mib]
    return [mib[i] * 2**20 for i in order] or None


def backend_started() -> bool:
    """Whether JAX's backends are up (then XLA_PYTHON_CLIENT_MEM_FRACTION is read already)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def _stderr_warning(msg: str) -> None:
    print(f"hmoe: warning: {msg}", file=sys.stderr)


_warned_late = False


def warn_if_fraction_unset(cards: list[int] | None = None, warn: Callable[[str], None] | None = None) -> bool:
    """JAX's backend is up and no memory fraction was set: on a GPU its allocator keeps
    JAX's default 0.75 of the card, less than a long prefill's plan may need. Warn once per
    process (an experiment builds many engines); nothing on a machine without a GPU."""
    global _warned_late
    if _warned_late or MEM_FRACTION_VAR in os.environ:
        return False
    if not (cards if cards is not None else query_gpu_mem_bytes()):
        return False
    _warned_late = True
    (warn or _stderr_warning)(
        f"JAX's backend started before {MEM_FRACTION_VAR} was set: its GPU allocator keeps JAX's "
        "default (0.75 of the card); call hmoe_jax.engine.gpu.set_gpu_mem_fraction before the first "
        "jax call, or set the variable"
    )
    return True


def set_gpu_mem_fraction(
    cfg: ModelConfig,
    schedule: str,
    prompt_tokens: int,
    devices: int = 1,
    system: SystemSpec | None = None,
    *,
    query: Callable[[], list[int] | None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> float | None:
    """Set XLA_PYTHON_CLIENT_MEM_FRACTION for a run of `schedule` on `prompt_tokens` tokens
    over `devices` GPUs: the plan's peak (plan/memory.py, estimated: no weights, no jax) on
    the smallest of those cards, plus headroom (gpu_mem_fraction). The plan is made for the
    real card (its ring slots and buffers follow the memory it has); `system` gives the rest
    of the machine, and when its card's memory disagrees with the real one by more than
    CARD_MISMATCH_TOLERANCE, `warn` says so (default: a line on stderr).

    Must run before JAX's backend starts (before any jax call that touches a device): JAX
    reads the variable once. Returns the fraction set, or None: the user set one, no GPU,
    the backend is already up, or the plan does not fit (the engine's plan then refuses it
    with the numbers)."""
    if MEM_FRACTION_VAR in os.environ:
        return None
    cards = (query or query_gpu_mem_bytes)()
    if not cards:
        return None
    warn = warn or _stderr_warning
    if backend_started():
        warn_if_fraction_unset(cards, warn)
        return None
    if len(cards) < devices:
        return None  # placement refuses too few GPUs with its own message
    card_bytes = min(cards[:devices])
    if system is not None:
        if abs(system.acc_mem_bytes - card_bytes) > CARD_MISMATCH_TOLERANCE * card_bytes:
            warn(
                f"system profile {system.name!r} has {system.acc_mem_bytes / GIB:.1f} GiB per accelerator, "
                f"this machine's GPU has {card_bytes / GIB:.1f} GiB (nvidia-smi): "
                "the memory fraction and the plan follow the real card"
            )
    else:
        system = SystemSpec(num_accelerators=devices)
    system = dataclasses.replace(system, acc_mem_bytes=card_bytes)
    try:
        sched = get_schedule(schedule)
        if schedule == "auto":
            sched = get_schedule(sched.choose(system, prompt_tokens, devices))
        budget = sched.budget(cfg, system, prompt_tokens, devices=sched.uses_devices(devices))
    except Exception as e:  # sizing is advisory: the run's own plan reports a bad option
        warn(f"{MEM_FRACTION_VAR} not set: no {schedule} plan for {prompt_tokens} tokens ({e})")
        return None
    if budget is None or not budget.fits:
        return None
    frac = gpu_mem_fraction(budget, system)
    os.environ[MEM_FRACTION_VAR] = f"{frac:.2f}"
    return frac
