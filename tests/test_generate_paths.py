"""One generate loop, one sampler: `hmoe generate` on the embedded (shipped) tiny model gives
the same tokens for one --seed whether it runs without --schedule (the plain path, which is
the engine's `reference` schedule) or with --schedule reference, cpu or slp; greedy too.

The equality across paths alone would also hold if every path ignored the seed or the
filters, so the sampled stream is checked against independent facts as well: it is not the
greedy stream, another seed gives another stream, and every sampled token is among the
top-k of the teacher-forced logits (`hmoe logits`'s plain forward, f32) at its position.
Warm-up compiles with the same sampling parameters and must not move the stream.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json

import numpy as np
import pytest

from hmoe_jax.cli import main

PROMPT, NEW = "def main(", 10
SAMPLED = ["--temperature", "0.9", "--top-p", "0.9", "--top-k", "5"]
GREEDY = ("--temperature", "0")  # explicit: the shipped generation_config.json samples by default
PATHS = {"plain": [], **{s: ["--schedule", s] for s in ("reference", "cpu", "slp")}}


@functools.cache
def _generate(path: str, sampling: tuple[str, ...], warmup: bool = False) -> dict:
    argv = ["generate", "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--ignore-eos", "--json"]
    argv += ["--quiet", *PATHS[path], *sampling, *([] if warmup else ["--no-warmup"])]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    assert rc == 0, out.getvalue()
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_greedy_stream_is_the_same_on_every_path():
    recs = {p: _generate(p, GREEDY) for p in PATHS}
    streams = {p: r["tokens"] for p, r in recs.items()}
    assert len(set(map(tuple, streams.values()))) == 1, streams
    assert recs["plain"]["schedule"] == recs["plain"]["schedule_requested"] == "reference"
    assert [recs[p]["schedule"] for p in ("cpu", "slp")] == ["cpu", "slp"]


def test_sampled_stream_is_the_same_on_every_path_and_follows_its_seed_and_filters(tmp_path):
    seeded = (*SAMPLED, "--seed", "7")
    streams = {p: _generate(p, seeded)["tokens"] for p in PATHS}
    assert len(set(map(tuple, streams.values()))) == 1, streams
    got = streams["plain"]
    rec = _generate("plain", seeded)
    assert (rec["temperature"], rec["top_p"], rec["top_k"], rec["seed"]) == (0.9, 0.9, 5, 7)

    assert got != _generate("plain", GREEDY)["tokens"], "sampling drew the greedy stream"
    assert got != _generate("plain", (*SAMPLED, "--seed", "8"))["tokens"], "the seed is not used"

    # Every token within the top 5 of the plain model's logits at its position.
    ids = ",".join(map(str, (rec["prompt_ids"] + got)[:-1]))
    out = tmp_path / "logits.npy"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["logits", "--tokens", ids, "--out", str(out), "--quiet"]) == 0
    logits = np.load(out)[len(rec["prompt_ids"]) - 1 :]  # row i predicts got[i]
    ranks = [int((row > row[tok]).sum()) for row, tok in zip(logits, got)]
    assert max(ranks) < 5, ranks


def test_warmup_compiles_without_moving_the_stream():
    seeded = (*SAMPLED, "--seed", "7")
    warm = _generate("plain", seeded, warmup=True)
    assert warm["tokens"] == _generate("plain", seeded)["tokens"]
    assert warm["warmup_s"] > 0 and _generate("plain", seeded)["warmup_s"] == 0
    assert warm["ttft_s"] > 0 and len(warm["decode_s"]) == NEW - 1
    assert warm["tpot_s"] == pytest.approx(float(np.median(warm["decode_s"])))
