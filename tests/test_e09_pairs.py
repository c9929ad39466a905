"""experiments/e09_serving.paired_ratios: each back-to-back (round, rep) pair's throughput ratio."""

import pytest

from experiments.e09_serving import paired_ratios


def _row(server, rnd, rep, tok_s, clients=1, part="decode"):
    return {
        "part": part,
        "server": server,
        "round": rnd,
        "rep": rep,
        "clients": clients,
        "output_tok_s": tok_s,
    }


def test_pairs_by_round_and_rep_and_skips_what_has_no_partner():
    rows = [
        _row("hmoe", 0, 0, 20.0),
        _row("llama-server", 0, 0, 16.0),
        _row("hmoe", 0, 1, 18.0),
        _row("llama-server", 0, 1, 20.0),
        _row("hmoe", 1, 0, 30.0),  # its peer run failed: no pair
        _row("llama-server", 1, 1, 10.0),  # no hmoe run of this (round, rep)
        _row("hmoe", 0, 0, 99.0, clients=2),  # another client count
        _row("llama-server", 0, 0, 1.0, clients=2),
        _row("hmoe", 0, 0, 5.0, part="join"),  # not a decode run
    ]
    assert paired_ratios(rows, 1) == pytest.approx([20.0 / 16.0, 18.0 / 20.0])
    assert paired_ratios(rows, 2) == pytest.approx([99.0])
    assert paired_ratios(rows, 4) == []


def test_rows_of_older_records_without_rep_pair_by_round():
    rows = [{k: v for k, v in _row(s, r, 0, t).items() if k != "rep"} for s, r, t in
            [("hmoe", 0, 12.0), ("llama-server", 0, 10.0), ("hmoe", 1, 9.0), ("llama-server", 1, 10.0)]]  # fmt: skip
    assert paired_ratios(rows, 1) == pytest.approx([1.2, 0.9])
