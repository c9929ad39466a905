"""`hmoe generate` / `hmoe serve` on the engine set JAX's GPU memory fraction from the plan's
memory budget on the real card before JAX starts (plan/memory.py, estimated, no weights; the
card from nvidia-smi, faked here), unless the user set one; no GPU: nothing set."""

from __future__ import annotations

import argparse
import os
import shutil

import pytest

from hmoe_jax.cli import generate as cli
from hmoe_jax.config import configs_dir
from hmoe_jax.engine import gpu
from hmoe_jax.plan.memory import GIB, MemoryBudget, gpu_mem_fraction
from hmoe_jax.plan.system import load_system
from hmoe_jax.schedules.registry import get_schedule

VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
PAPER = "paper_epyc9355_rtx5090"


@pytest.fixture
def card(monkeypatch):
    """A faked real card (nvidia-smi's memory.total), JAX's backend not started yet."""
    cards: list[int] = []
    monkeypatch.setattr(gpu, "query_gpu_mem_bytes", lambda: list(cards))
    monkeypatch.setattr(gpu, "backend_started", lambda: False)
    return cards


def _args(ckpt, **kw):
    base = dict(
        command="generate", checkpoint=ckpt, schedule=None, devices=None, system="paper_epyc9355_rtx5090"
    )
    return argparse.Namespace(**{**base, "tokens": ",".join(["5"] * 8000), "prompt": None, **kw})


def test_fraction_follows_the_plan(tmp_path, monkeypatch, card, capsys):
    shutil.copy(configs_dir() / "models" / "deepseek_v3.json", tmp_path / "config.json")
    monkeypatch.delenv(VAR, raising=False)
    assert cli.set_gpu_mem_fraction(_args(tmp_path)) is None  # no GPU: nothing set
    assert VAR not in os.environ
    card.append(32 * GIB)  # the profile's RTX 5090
    frac = cli.set_gpu_mem_fraction(_args(tmp_path))
    # By hand: auto takes slp at 8000 tokens; slp's plan on the RTX 5090 (32 GiB) peaks at
    # ~97% of the card (tests/test_plan_memory.py checks the plan), so peak + 5% headroom is
    # over what the 1 GiB reserve leaves: (32 - 1) / 32 = 0.96875, rounded down to 0.96.
    from hmoe_jax.config import load_config

    cfg, system = load_config(tmp_path / "config.json"), load_system(PAPER, 1)
    peak = get_schedule("slp").budget(cfg, system, 8000).acc_peak_bytes
    assert system.acc_mem_bytes == 32 * GIB and peak / system.acc_mem_bytes + 0.05 > 0.96
    assert frac == 0.96
    assert os.environ[VAR] == "0.96"
    assert "warning" not in capsys.readouterr().err  # --system's card is the real one


def test_real_card_wins_over_the_system_profile_with_a_warning(tmp_path, monkeypatch, card, capsys):
    """--system says 32 GiB, the machine has an 80 GB H100 (nvidia-smi: 81,559 MiB): the
    fraction is sized on the real card, and a warning names both."""
    shutil.copy(configs_dir() / "models" / "deepseek_v3.json", tmp_path / "config.json")
    monkeypatch.delenv(VAR, raising=False)
    card.append(81559 * 2**20)
    frac = cli.set_gpu_mem_fraction(_args(tmp_path, tokens="5,5,5"))
    err = capsys.readouterr().err
    assert "warning" in err and "32.0 GiB" in err and "79.6 GiB" in err  # 81,559 MiB / 1,024
    # By hand: 3 tokens run auto's cpu prefill; its accelerator peak on an 80 GB card is far
    # under 70%, so JAX's default 0.75 stays (the 32 GiB profile gives the same here).
    assert frac == 0.75 and os.environ[VAR] == "0.75"
    monkeypatch.delenv(VAR)
    # the 8000-token slp plan on the real 79.6 GiB card: its peak (ring slots from what the
    # card leaves) is under the 32 GiB profile's 0.96 cap, and at most (79.6 - 1) / 79.6 -> 0.98
    big = cli.set_gpu_mem_fraction(_args(tmp_path))
    assert big is not None and 0.75 <= big <= 0.98


def test_serve_sizes_its_max_model_len_prompt(tmp_path, monkeypatch, card):
    shutil.copy(configs_dir() / "models" / "deepseek_v3.json", tmp_path / "config.json")
    monkeypatch.delenv(VAR, raising=False)
    card.append(32 * GIB)
    serve = argparse.Namespace(
        command="serve", checkpoint=tmp_path, devices=None, system=PAPER, max_model_len=8000, pd=False
    )
    # the same 8000-token slp plan as generate's (auto takes slp there): 0.96 by hand above
    assert cli.set_gpu_mem_fraction(serve) == 0.96
    monkeypatch.delenv(VAR)
    assert cli.set_gpu_mem_fraction(argparse.Namespace(**{**vars(serve), "checkpoint": None})) is None


def _budget(peak_gib: float, card_gib: int = 32) -> MemoryBudget:
    return MemoryBudget(
        schedule="slp",
        tokens=1,
        acc_mem_bytes=card_gib * GIB,
        resident_bytes=int(peak_gib * GIB),
        ring_bytes=0,
        cache_bytes=0,
        temp_bytes=0,
        temp_measured=True,
        temp_stage="-",
    )


def test_fraction_arithmetic_by_hand():
    """peak / card + 5% headroom, rounded UP to 0.01, at least JAX's default 0.75, at most
    what the 1 GiB reserve leaves (rounded down)."""
    system = load_system(PAPER, 1)  # 32 GiB
    assert gpu_mem_fraction(_budget(8.0), system) == 0.75  # 0.25 + 0.05: JAX's default stays
    assert gpu_mem_fraction(_budget(26.0), system) == 0.87  # 0.8125 + 0.05 = 0.8625 -> 0.87
    assert gpu_mem_fraction(_budget(28.0), system) == 0.93  # 0.875 + 0.05 = 0.925 -> 0.93
    assert gpu_mem_fraction(_budget(30.0), system) == 0.96  # 0.9875: capped at 31 / 32 -> 0.96


def test_user_setting_and_plain_runs_are_left_alone(tmp_path, monkeypatch, card):
    shutil.copy(configs_dir() / "models" / "deepseek_v3.json", tmp_path / "config.json")
    card.append(32 * GIB)
    monkeypatch.setenv(VAR, "0.5")
    assert cli.set_gpu_mem_fraction(_args(tmp_path)) is None
    monkeypatch.delenv(VAR)
    assert cli.set_gpu_mem_fraction(_args(None)) is None  # embedded model, plain path
    assert cli.set_gpu_mem_fraction(_args(tmp_path, schedule="none")) is None
