"""Lazy loading of the compiled extension `_hmoe_ffi` and registration of its targets.

Order matters (shared/NOTES.md): the CPU backend must exist before FFI types/targets are
registered, else XLA answers FAILED_PRECONDITION.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import jax


class FfiUnavailable(ImportError):
    pass


@functools.cache
def extension() -> ModuleType:
    try:
        return importlib.import_module("_hmoe_ffi")
    except ImportError as e:
        raise FfiUnavailable(
            "the compiled extension _hmoe_ffi is not importable; install the package "
            "(pip install .) or build it (tools/build_ffi.sh build/dev; PYTHONPATH=build/dev)"
        ) from e


@functools.cache
def register_all() -> tuple[str, ...]:
    """Register every `hmoe_*` CPU target once; returns their names."""
    ext = extension()
    jax.devices("cpu")  # initialise the CPU backend first
    names = []
    for name, handler in ext.registrations().items():
        jax.ffi.register_ffi_target(name, handler, platform="cpu")
        names.append(name)
    return tuple(sorted(names))


def cpu_features() -> dict:
    return dict(extension().cpu_features())
