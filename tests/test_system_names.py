"""One `--system` vocabulary (issue 24): `hmoe plan`, `hmoe simulate` and `hmoe generate
--schedule auto` take the same profile names (configs/systems/*.toml) with the same
`--devices`, resolve `auto` by the same profile's [schedule] thresholds, and refuse an
unknown name the same way, listing the known profiles.

The oracle for `auto` is the paper's rule written out here (schedules/auto.py): a prompt
shorter than auto_slp_min_tokens runs `cpu`, a longer one `slp` on one accelerator; each
profile's threshold is read from its TOML file directly."""

from __future__ import annotations

import json
import tomllib

import pytest

from hmoe_jax.cli import main
from hmoe_jax.config import ConfigError, configs_dir
from hmoe_jax.plan.profile import profile_names

SYSTEMS = configs_dir() / "systems"
PROMPT = 16  # tokens: below every shipped threshold, above the low one of the test's own box


def _low_threshold_box(tmp_path) -> str:
    """The paper box with auto_slp_min_tokens = 8: `auto` must pick slp for PROMPT tokens."""
    raw = (SYSTEMS / "paper_epyc9355_rtx5090.toml").read_text()
    low = raw.replace("auto_slp_min_tokens = { value = 4096,", "auto_slp_min_tokens = { value = 8,")
    assert low != raw
    f = tmp_path / "low_threshold.toml"
    f.write_text(low)
    return str(f)


def _auto_by_the_rule(system: str) -> str:
    path = system if system.endswith(".toml") else str(SYSTEMS / f"{system}.toml")
    with open(path, "rb") as fh:
        threshold = tomllib.load(fh)["schedule"]["auto_slp_min_tokens"]["value"]
    return "cpu" if PROMPT < threshold else "slp"


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _three_commands(system: str, capsys) -> dict[str, dict]:
    common = ["--system", system, "--devices", "1", "--schedule", "auto", "--json"]
    out = {}
    rc = main(["plan", "--model", "deepseek_v3_tiny", "--prompt-len", str(PROMPT), "--no-measure", *common])
    out["plan"] = _last_json(capsys)
    assert rc == 0, out["plan"]
    assert main(["simulate", "--model", "deepseek_v3_tiny", "--prompt-len", str(PROMPT), *common]) == 0
    out["simulate"] = _last_json(capsys)
    tokens = ",".join(str(3 + i) for i in range(PROMPT))
    argv = ["generate", "--tokens", tokens, "--max-new-tokens", "2", "--quiet", "--no-warmup", *common]
    assert main(argv) == 0
    out["generate"] = _last_json(capsys)
    return out


@pytest.mark.parametrize("name", [*profile_names(), "low_threshold"])
def test_plan_simulate_generate_take_the_same_system_names(name, tmp_path, capsys):
    system = _low_threshold_box(tmp_path) if name == "low_threshold" else name
    want = _auto_by_the_rule(system)
    if name == "low_threshold":
        assert want == "slp"  # the box's own thresholds, not a default, decide
    out = _three_commands(system, capsys)
    for cmd, rec in out.items():
        assert rec["schedule"] == want, (cmd, rec["schedule"])
    assert out["plan"]["system"] == out["simulate"]["profile"] == out["generate"]["system"]
    assert out["plan"]["devices"] == out["simulate"]["accelerators"] == out["generate"]["devices"] == 1


def test_an_unknown_system_is_refused_by_all_three_listing_the_known_ones(capsys):
    known = profile_names()
    for argv in (
        ["plan", "--model", "deepseek_v3_tiny", "--schedule", "auto", "--prompt-len", "8", "--no-measure"],
        ["simulate", "--model", "deepseek_v3_tiny", "--schedule", "auto", "--prompt-len", "8"],
        ["generate", "--tokens", "3,4,5", "--schedule", "auto", "--max-new-tokens", "1", "--quiet"],
    ):
        try:
            rc = main([*argv, "--system", "rtx5090_x1"])  # the retired JSON name
        except ConfigError as e:
            msg = str(e)
        else:
            assert rc != 0, argv[0]
            msg = capsys.readouterr().err
        assert "rtx5090_x1" in msg and all(n in msg for n in known), (argv[0], msg)
