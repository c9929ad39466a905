"""The ISA the extension reports (`cpu_features()["best_isa"]`, written into every experiment
record) is one with a kernel, and it is the one the kernels run: there is no AMX kernel, so
AMX is a detected CPU feature (`amx_bf16`), never the reported ISA. The oracle is the source
tree (a kernel ISA has its xla_ffi/src/gemm_<isa>.cc) and the ISA index the MoE op returns
in its stats (what actually ran), not the detection code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hmoe_jax.kernels import ffi

try:
    ffi.register_all()
except ffi.FfiUnavailable as e:  # pragma: no cover - the build is part of the test setup
    pytest.skip(f"_hmoe_ffi not built: {e}", allow_module_level=True)

from hmoe_jax.kernels.moe import moe_experts_with_stats  # noqa: E402
from hmoe_jax.model.params import ExpertsParams  # noqa: E402
from hmoe_jax.quant.fp8 import quantize_np  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "xla_ffi" / "src"
ISA_INDEX = {"portable": 0, "avx2": 1, "avx512": 2}  # xla_ffi/src/cpu_features.h, enum Isa


def test_reported_isa_has_a_kernel():
    best = ffi.cpu_features()["best_isa"]
    assert (SRC / f"gemm_{best}.cc").exists(), f"best_isa {best!r} has no kernel (no gemm_{best}.cc)"


def test_reported_isa_is_the_one_that_runs():
    rng = np.random.default_rng(0)
    e, inter, d = 4, 128, 256

    def mat(*shape):
        return quantize_np(rng.standard_normal(shape).astype(np.float32) * 0.05)

    ex = ExpertsParams(gate=mat(e, inter, d), up=mat(e, inter, d), down=mat(e, d, inter))
    x = rng.standard_normal((2, d)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3]], np.int32)
    w = np.full((2, 2), 0.5, np.float32)
    _, stats = moe_experts_with_stats(x, ids, w, ex)  # max_isa None: the best this CPU has
    assert stats["isa"] == ISA_INDEX[ffi.cpu_features()["best_isa"]]


def test_no_amx_path_can_be_requested():
    assert not (SRC / "gemm_amx.cc").exists()  # when an AMX kernel lands, this test changes with it
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(ValueError, match="max_isa"):
        moe_experts_with_stats(
            x, np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32), None, max_isa="amx"
        )


def test_growing_batches_after_a_single_row_run_on_any_cpu(tmp_path):
    """The MoE op at M=1, then 2, 3 and 8 rows, in a fresh process: growing its packed
    buffers once called a std::vector member compiled with AVX-512 flags (a weak symbol
    from gemm_avx512.cc that the linker kept for the whole extension) and died with SIGILL
    on an AVX2-only CPU (xla_ffi/src/isa_scratch.h). A subprocess, so a crash is a failure
    here, not the end of the test run; the rows must also equal the op's single-row result."""
    import subprocess
    import sys

    script = tmp_path / "grow.py"
    script.write_text(
        "import numpy as np, jax, jax.numpy as jnp\n"
        "from hmoe_jax.config import named_model_config\n"
        "from hmoe_jax.runtime.synthetic import random_params\n"
        "from hmoe_jax.kernels.moe import moe_experts\n"
        "cfg = named_model_config('deepseek_v3_tiny')\n"
        "ex = random_params(cfg, seed=5).layers[-1].ffn.experts\n"
        "rng = np.random.default_rng(0)\n"
        "x8 = rng.standard_normal((8, cfg.hidden_size)).astype(np.float32)\n"
        "ids8 = rng.integers(0, cfg.n_routed_experts, (8, cfg.num_experts_per_tok)).astype(np.int32)\n"
        "f = jax.jit(moe_experts)\n"
        "one = [np.asarray(f(jnp.asarray(x8[i:i+1]), jnp.asarray(ids8[i:i+1]), jnp.ones((1, ids8.shape[1]), jnp.float32), ex)) for i in range(8)]\n"
        "for m in (1, 2, 3, 8):\n"
        "    y = np.asarray(f(jnp.asarray(x8[:m]), jnp.asarray(ids8[:m]), jnp.ones((m, ids8.shape[1]), jnp.float32), ex))\n"
        "    np.testing.assert_allclose(y, np.concatenate(one[:m]), rtol=1e-5, atol=1e-6)\n"
        "print('ok')\n"
    )
    import os

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (
        f"exit {r.returncode} (-4 is SIGILL: ISA code on a portable path)\n{r.stderr[-2000:]}"
    )
