"""Load a checkpoint directory into (ModelConfig, ModelParams): the one entry point every
command, the Engine API and the experiments use.

One host-weight path. An HF-format safetensors directory is converted once into a weight
arena in the cache (hmoe_jax.io.arena.ensure_arena: page-aligned, routed experts stacked
[E, ...] as the kernels take them; progress on a terminal, free disk checked first) and
from then on served by mapping that arena read-only: every leaf, experts included, is a
view of the arena file's pages, so the host holds the weights once (~1x the checkpoint in
RSS), never a stacked copy of the experts beside the checkpoint's own maps. An arena
directory (`hmoe convert --format arena`) is mapped as it is. FP8 weights stay FP8 (an
`Fp8Tensor` of the e4m3 view plus its float32 `weight_scale_inv` view).
"""

from __future__ import annotations

from pathlib import Path

from hmoe_jax.config import ModelConfig
from hmoe_jax.io.arena import ArenaError, ensure_arena, is_arena, load_arena
from hmoe_jax.io.cache import discard
from hmoe_jax.io.errors import CheckpointError
from hmoe_jax.model.params import ModelParams


def load_checkpoint(
    path: str | Path,
    *,
    progress: bool = True,
    upcast_f32: bool = False,
    arena_dir: str | Path | None = None,
) -> tuple[ModelConfig, ModelParams]:
    """Load a checkpoint directory (safetensors, or an arena). `upcast_f32` converts
    non-expert bf16/f16 leaves to float32 copies (for f32 compute without per-call
    converts); FP8 and experts stay as stored. `arena_dir`: where converted arenas are
    cached (default hmoe_jax.io.cache.arena_cache_dir(), overridable with $HMOE_ARENA_DIR).
    Raises ConfigError / CheckpointError with one-line messages."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory not found")
    if is_arena(root):
        return load_arena(root, upcast_f32=upcast_f32, progress=progress)
    cached = ensure_arena(root, arena_dir, progress=progress)
    try:
        return load_arena(cached, upcast_f32=upcast_f32, progress=progress)
    except ArenaError:
        # check_intact passed but a leaf entry is bad (an index edited or torn in a way that
        # keeps its size): the cache is ours to rebuild; a second failure is a real error.
        discard(cached)
        return load_arena(
            ensure_arena(root, arena_dir, progress=progress), upcast_f32=upcast_f32, progress=progress
        )
