"""What a GPU run needs, checked without a GPU (engine/gpu.py): JAX_PLATFORMS must keep the
cpu backend, --require-gpu / Engine(require_gpu=True) refuses a CPU fallback, and the real
card's memory comes from nvidia-smi's output (faked here: there is no GPU on this machine)."""

from __future__ import annotations

import subprocess

import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.engine import gpu
from hmoe_jax.engine.gpu import PlatformError, check_gpu, check_platforms, query_gpu_mem_bytes

MIB = 2**20


@pytest.mark.parametrize("value", ["cuda", "gpu", "CUDA", "cuda,rocm", " cuda "])
def test_platforms_without_cpu_are_refused_naming_the_fix(value):
    with pytest.raises(PlatformError) as e:
        check_platforms({"JAX_PLATFORMS": value})
    msg = str(e.value)
    assert f"JAX_PLATFORMS={value}" in msg and "cpu backend" in msg
    want = "gpu,cpu" if value == "gpu" else "cuda,cpu"
    assert f"JAX_PLATFORMS={want}" in msg


@pytest.mark.parametrize(
    "env", [{}, {"JAX_PLATFORMS": ""}, {"JAX_PLATFORMS": "cpu"}, {"JAX_PLATFORMS": "cuda,cpu"}]
)
def test_platforms_with_cpu_or_unset_pass(env):
    check_platforms(env)


def _devices(gpus: list[str]):
    def devices(backend: str):
        if backend == "gpu":
            if not gpus:
                raise RuntimeError(
                    "Unknown backend: 'gpu' requested, but no platforms that are instances of gpu"
                )
            return gpus
        assert backend == "cpu"
        return ["TFRT_CPU_0"]

    return devices


def test_require_gpu_refuses_a_cpu_fallback():
    with pytest.raises(PlatformError) as e:
        check_gpu(required=True, devices=_devices([]))
    msg = str(e.value)
    assert "--require-gpu" in msg and "no GPU" in msg and "TFRT_CPU_0" in msg and "[cuda13]" in msg
    assert check_gpu(required=False, devices=_devices([])) == []
    assert check_gpu(required=True, devices=_devices(["cuda:0", "cuda:1"])) == ["cuda:0", "cuda:1"]


def _smi(stdout: str, rc: int = 0):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, rc, stdout=stdout, stderr="")

    return run, calls


def test_card_memory_from_nvidia_smi_output():
    run, calls = _smi("0, 81559\n1, 32607\n")
    # by hand: MiB * 2**20
    assert query_gpu_mem_bytes(run, env={}) == [81559 * MIB, 32607 * MIB]
    assert calls and calls[0][0] == "nvidia-smi" and "--query-gpu=index,memory.total" in calls[0]
    # CUDA_VISIBLE_DEVICES selects and orders the cards as CUDA will
    assert query_gpu_mem_bytes(run, env={"CUDA_VISIBLE_DEVICES": "1,0"}) == [32607 * MIB, 81559 * MIB]
    assert query_gpu_mem_bytes(run, env={"CUDA_VISIBLE_DEVICES": "1"}) == [32607 * MIB]


def test_no_gpu_means_no_card():
    assert query_gpu_mem_bytes(_smi("", rc=9)[0], env={}) is None  # driver error: NVIDIA-SMI has failed
    assert query_gpu_mem_bytes(_smi("No devices were found\n")[0], env={}) is None

    def missing(cmd, **kw):
        raise FileNotFoundError(cmd[0])

    assert query_gpu_mem_bytes(missing, env={}) is None


def test_engine_checks_platforms_and_refuses_cpu_fallback(monkeypatch):
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.runtime.synthetic import random_params

    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=3)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    with pytest.raises(PlatformError, match="cuda,cpu"):
        Engine(params, cfg, expert_fn="ref")
    monkeypatch.delenv("JAX_PLATFORMS")
    with pytest.raises(PlatformError, match="--require-gpu"):  # this machine has no GPU
        Engine(params, cfg, expert_fn="ref", require_gpu=True)
    assert Engine(params, cfg, expert_fn="ref").placement.stand_in  # the default still runs on CPU


def test_cli_refuses_before_loading_weights(monkeypatch, capsys):
    from hmoe_jax.cli.app import main

    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert main(["generate", "--tokens", "1,2", "--max-new-tokens", "1", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hmoe: error: JAX_PLATFORMS=cuda") and "JAX_PLATFORMS=cuda,cpu" in err
    monkeypatch.delenv("JAX_PLATFORMS")
    assert main(["generate", "--tokens", "1,2", "--max-new-tokens", "1", "--quiet", "--require-gpu"]) == 1
    assert "hmoe: error: --require-gpu: JAX found no GPU" in capsys.readouterr().err


def test_serve_passes_require_gpu_to_its_engines(monkeypatch):
    """`hmoe serve --pd --require-gpu` hands require_gpu to both workers' Engine options (a
    stand-in coordinator records them: no worker starts; build_run's own check is passed by
    loading the model without the flag)."""
    import hmoe_jax.serve.pd as pd_mod
    from hmoe_jax.cli.app import build_parser
    from hmoe_jax.cli.run import build_run
    from hmoe_jax.serve.http_server import build_state

    seen = {}

    class Recorder:
        healthy = True

        def __init__(self, checkpoint, policy, **kw):
            seen.update(kw)

        def wait_ready(self):
            return self

        def restarts(self):
            return {}

        def close(self):
            pass

    monkeypatch.setattr(pd_mod, "PDCoordinator", Recorder)
    args = build_parser().parse_args(["serve", "--pd", "--devices", "2", "--quiet"])
    assert args.require_gpu is False
    run = build_run(args)
    build_state(args, run)
    assert seen["engine"]["require_gpu"] is False
    build_state(build_parser().parse_args(["serve", "--pd", "--devices", "2", "--require-gpu"]), run)
    assert seen["engine"]["require_gpu"] is True


def test_late_fraction_warns_once_and_only_on_a_gpu(monkeypatch):
    monkeypatch.delenv(gpu.MEM_FRACTION_VAR, raising=False)
    monkeypatch.setattr(gpu, "_warned_late", False)
    said: list[str] = []
    assert not gpu.warn_if_fraction_unset([], said.append)  # no GPU: nothing to say
    monkeypatch.setattr(gpu, "query_gpu_mem_bytes", lambda: None)
    assert not gpu.warn_if_fraction_unset(None, said.append)
    assert gpu.warn_if_fraction_unset([32 * 2**30], said.append)
    assert not gpu.warn_if_fraction_unset([32 * 2**30], said.append)  # once per process
    assert len(said) == 1 and gpu.MEM_FRACTION_VAR in said[0] and "0.75" in said[0]
