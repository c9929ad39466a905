"""The simulator's fingerprint: what a frozen validation run (experiments/e10) holds fixed.

A frozen, held-out validation (issue 27 item 5) is only held out if the model it validates did
not move between its rounds, nor after them without a new run. `sim_fingerprint` hashes the
two things that decide a simulated time for a given plan: the simulator's code and the
machine profile it prices on. Every validation record (e03, e04, e05, e06) carries it, and e10
refuses to pool records whose fingerprints differ.

What is hashed, and why exactly these files:
- every .py under hmoe_jax/sim/ (the pricing, the event loop, interference, serving replay);
- the hmoe_jax/plan/ modules the simulator imports, directly or through each other
  (SIM_PLAN_MODULES; tests/test_e10_frozen.py re-derives the set from the imports): the
  formulas it prices ops with (costs, memory, tensors, buckets), the plan format it reads,
  the profile loader and SystemSpec it derives the plan options from, and trace's
  attention/MoE split used by serving replay. plan/dist.py is not read by the simulator;
- the profile file's bytes (configs/systems/local.toml for the validations here).
Not hashed: the schedules and policies that build the plans. They are the engine's code too,
so a change there changes both sides of a validation row (what is validated, not the model
of it); the records' environment.git_sha says which commit ran.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # hmoe_jax/

# sorted; the transitive closure of hmoe_jax.plan imports from hmoe_jax/sim/*.py
SIM_PLAN_MODULES = (
    "__init__.py",  # empty, but imported by `from hmoe_jax.plan import costs`
    "buckets.py",
    "costs.py",
    "format.py",
    "memory.py",
    "profile.py",
    "system.py",
    "tensors.py",
    "trace.py",
)


def sim_source_files(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The hashed sources, sorted by their path relative to the package directory."""
    sim = sorted((package_dir / "sim").glob("*.py"))
    plan = [package_dir / "plan" / m for m in SIM_PLAN_MODULES]
    missing = [str(p) for p in plan if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"simulator fingerprint: plan modules missing: {missing}")
    if not sim:
        raise FileNotFoundError(f"simulator fingerprint: no .py files under {package_dir / 'sim'}")
    return sorted(sim + plan, key=lambda p: p.relative_to(package_dir).as_posix())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sim_fingerprint(profile_path: str | Path, package_dir: Path = PACKAGE_DIR) -> dict[str, Any]:
    """{"sha256": one hash over the sources and the profile, "sources_sha256", "profile_sha256",
    "profile", "files": {relative path: sha256}}. The combined hash covers each file's relative
    path and bytes (a rename or a moved line both change it)."""
    profile = Path(profile_path)
    if not profile.is_file():
        raise FileNotFoundError(f"simulator fingerprint: profile {profile} not found")
    files = {
        p.relative_to(package_dir).as_posix(): _sha256(p.read_bytes()) for p in sim_source_files(package_dir)
    }
    sources = _sha256("".join(f"{k}\0{v}\n" for k, v in files.items()).encode())
    prof = _sha256(profile.read_bytes())
    return {
        "sha256": _sha256(f"sources\0{sources}\nprofile\0{prof}\n".encode()),
        "sources_sha256": sources,
        "profile_sha256": prof,
        "profile": profile.name,
        "files": files,
    }


def local_fingerprint() -> dict[str, Any]:
    """The fingerprint of the validations here: the simulator on configs/systems/local.toml."""
    from hmoe_jax.plan.profile import profiles_dir

    return sim_fingerprint(profiles_dir() / "local.toml")
