"""`hmoe generate` on the engine sets JAX's GPU memory fraction from its plan's memory budget
before JAX starts (plan/memory.py; estimated, no weights), unless the user set one."""

from __future__ import annotations

import argparse
import shutil

from hmoe_jax.cli import generate as cli
from hmoe_jax.config import configs_dir
from hmoe_jax.plan.memory import gpu_mem_fraction
from hmoe_jax.plan.system import load_system
from hmoe_jax.schedules.registry import get_schedule

VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def _args(ckpt, **kw):
    base = dict(command="generate", checkpoint=ckpt, schedule=None, devices=None, system="rtx5090_x1")
    return argparse.Namespace(**{**base, "tokens": ",".join(["5"] * 8000), "prompt": None, **kw})


def test_fraction_follows_the_plan(tmp_path, monkeypatch):
    shutil.copy(configs_dir() / "models" / "deepseek_v3.json", tmp_path / "config.json")
    monkeypatch.delenv(VAR, raising=False)
    frac = cli.set_gpu_mem_fraction(_args(tmp_path))
    from hmoe_jax.config import load_config

    cfg, system = load_config(tmp_path / "config.json"), load_system("rtx5090_x1")
    want = gpu_mem_fraction(get_schedule("slp").budget(cfg, system, 8000), system)  # auto: 8000 -> slp
    assert frac == want and 0.75 <= frac <= 0.97
    assert float(__import__("os").environ[VAR]) == round(frac, 2)


def test_user_setting_and_plain_runs_are_left_alone(tmp_path, monkeypatch):
    shutil.copy(configs_dir() / "models" / "deepseek_v3.json", tmp_path / "config.json")
    monkeypatch.setenv(VAR, "0.5")
    assert cli.set_gpu_mem_fraction(_args(tmp_path)) is None
    monkeypatch.delenv(VAR)
    assert cli.set_gpu_mem_fraction(_args(None)) is None  # embedded model, plain path
    assert cli.set_gpu_mem_fraction(_args(tmp_path, schedule="none")) is None
