"""`hmoe simulate` (last stdout line JSON with the documented keys, bad input -> exit 1) and
`hmoe reproduce`'s claims table built from records."""

from __future__ import annotations

import json

from hmoe_jax.cli import main
from hmoe_jax.cli import reproduce as cli_reproduce


def test_simulate_json_last_line_has_the_documented_keys(capsys):
    rc = main(
        [
            "simulate",
            "--model",
            "deepseek_v3",
            "--system",
            "paper_epyc9355_rtx5090",
            "--devices",
            "1",
            "--schedule",
            "cpu",
            "--prompt-len",
            "512",
            "--decode-tokens",
            "4",
            "--batch",
            "2",
            "--json",
        ]
    )
    assert rc == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for k in (
        "ttft_s",
        "prefill_tok_per_s",
        "decode_tok_per_s",
        "binding",
        "binding_share",
        "assumed_inputs",
    ):
        assert k in rec, k
    assert rec["binding"]["decode"].startswith("xbw")  # CPU experts' reads bound decode
    assert rec["decode_agg_tok_per_s"] == rec["decode_tok_per_s"] * 2
    assert "accelerator.compute_efficiency" in rec["assumed_inputs"]


def test_simulate_bad_input_is_one_line_error(capsys):
    rc = main(
        ["simulate", "--model", "deepseek_v3", "--system", "nope", "--schedule", "slp", "--prompt-len", "8"]
    )
    assert rc == 1
    assert "not found" in capsys.readouterr().err
    rc = main(
        [
            "simulate",
            "--model",
            "deepseek_v3",
            "--system",
            "paper_epyc9355_rtx5090",
            "--schedule",
            "slp",
            "--prompt-len",
            "0",
        ]
    )
    assert rc == 1


def test_reproduce_table_from_records(tmp_path, monkeypatch):
    (tmp_path / "results").mkdir()
    (tmp_path / "experiments").mkdir()
    rec = {
        "claim": "c",
        "paper_value": {"slp_tok_per_s": 1200},
        "summary": {"slp_tok_per_s_20k": 767.4, "slp_max_prompt_30s": 22528, "sim_error_prefill": 9.5},
    }
    (tmp_path / "results" / "e04_slp_prefill_20261204T000000Z.json").write_text(json.dumps(rec))
    (tmp_path / "experiments" / "README.md").write_text("# Experiments\n\nhand-written table\n")
    (tmp_path / "experiments" / "e04_slp_prefill.py").write_text("")  # experiments are discovered
    monkeypatch.setattr(cli_reproduce, "ROOT", tmp_path)
    rows = cli_reproduce.table_rows()
    assert rows[0]["projected"].startswith("slp_tok_per_s_20k 767")
    assert rows[0]["measured"] == "sim_error_prefill 9.5"
    path = cli_reproduce.write_readme(cli_reproduce.markdown(rows))
    path = cli_reproduce.write_readme(cli_reproduce.markdown(rows))  # idempotent: one block
    text = path.read_text()
    assert text.count(cli_reproduce.BEGIN) == 1 and "hand-written table" in text


def test_reproduce_finds_the_checkout_it_runs_in(tmp_path, monkeypatch, capsys):
    """`pip install .` puts only the package in site-packages: `hmoe reproduce` runs the
    experiments of the checkout it is started in, and says so when there is none."""
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "e99_demo.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert cli_reproduce.find_root() == tmp_path.resolve()
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    monkeypatch.setattr(cli_reproduce, "ROOT", empty)
    args = cli_reproduce.argparse.Namespace(only=None, table_only=False, out_dir=None, quick=True)
    assert cli_reproduce.cmd_reproduce(args) == 2
    assert "run it from the root of a source checkout" in capsys.readouterr().err


def test_calibrate_writes_the_profile_of_the_checkout_it_runs_in(tmp_path, monkeypatch):
    """Run inside a source checkout, `hmoe calibrate` writes that checkout's
    configs/systems/local.toml (what its experiments read), even when the package itself is a
    plain install with its own copy of configs; elsewhere, the package's."""
    import argparse

    from hmoe_jax.cli import calibrate as cli_calibrate

    written: list = []
    monkeypatch.setattr(cli_calibrate, "calibrate", lambda **_: {"calibrate_s": 0.0})
    monkeypatch.setattr(cli_calibrate, "write_profile", lambda path, m: written.append(path))
    monkeypatch.setattr("hmoe_jax.sim.profile.load_profile", lambda p: None)
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "e99_x.py").write_text("")
    (tmp_path / "configs" / "systems").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(out=None, quick=True, json=False)
    assert cli_calibrate.cmd_calibrate(args) == 0
    assert written == [tmp_path / "configs" / "systems" / "local.toml"]
    elsewhere = tmp_path / "not_a_checkout"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli_calibrate.cmd_calibrate(args) == 0
    from hmoe_jax.sim.profile import profiles_dir

    assert written[1] == profiles_dir() / "local.toml"
