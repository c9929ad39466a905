"""measure/calibrate.combine_blocks: blocks of one calibrate measurement, taken at different
times, combined by medians; a (rate, probe) pair by the median of its ratios (the efficiency
the profile keeps). Hand arithmetic."""

from __future__ import annotations

import pytest

from hmoe_jax.measure.calibrate import combine_blocks
from hmoe_jax.measure.local_profile import _blocks_note


def test_medians_per_key_and_the_median_ratio_of_a_pair():
    blocks = [
        {"m1_gbps": 10.0, "m1_probe_gbps": 20.0, "prefill_tflops": 0.10},  # ratio 0.50
        {"m1_gbps": 18.0, "m1_probe_gbps": 24.0, "prefill_tflops": 0.14},  # ratio 0.75
        {"m1_gbps": 11.2, "m1_probe_gbps": 16.0, "prefill_tflops": 0.12},  # ratio 0.70
    ]
    out = combine_blocks(blocks)
    assert out["blocks"] == 3
    assert out["prefill_tflops"] == pytest.approx(0.12)
    assert out["m1_probe_gbps"] == pytest.approx(20.0)
    # the efficiency is the median of the blocks' ratios, not median rate / median probe
    assert out["m1_gbps"] / out["m1_probe_gbps"] == pytest.approx(0.70)
    assert 11.2 / 20.0 != pytest.approx(0.70)
    assert out["m1_gbps_ratios"] == pytest.approx([0.5, 0.75, 0.7])
    with pytest.raises(ValueError, match="no blocks"):
        combine_blocks([])


def test_one_block_is_itself_and_the_profile_note_names_the_spread():
    one = combine_blocks([{"m1_gbps": 12.0, "m1_probe_gbps": 24.0}])
    assert one["m1_gbps"] == pytest.approx(12.0)
    assert _blocks_note(one.get("m1_gbps_ratios")) == ""
    three = combine_blocks([{"m1_gbps": g, "m1_probe_gbps": 20.0} for g in (11.8, 13.0, 14.2)])
    note = _blocks_note(three["m1_gbps_ratios"])
    assert note == ", median of 3 blocks spread over the calibration (0.59-0.71)"


def test_attention_blocks_combine_by_form_and_chunk_size():
    from hmoe_jax.measure.standin import combine_attention

    def block(a_s: float, e_s: float) -> dict:
        def one(t: int, s: float) -> dict:
            return {"tokens": t, "model": "m", "seconds": s, "tflops": 1.0 / s}

        return {
            "absorbed": {**one(128, a_s), "small": one(64, a_s / 2)},
            "expanded": {**one(512, e_s), "small": one(256, e_s / 4)},
        }

    out = combine_attention([block(0.2, 1.0), block(0.1, 3.0), block(0.4, 2.0)])
    assert out["absorbed"]["seconds"] == pytest.approx(0.2)
    assert out["absorbed"]["tflops"] == pytest.approx(5.0)  # median of 5, 10, 2.5
    assert out["absorbed"]["small"]["seconds"] == pytest.approx(0.1)
    assert out["expanded"]["tflops"] == pytest.approx(0.5)  # median of 1, 1/3, 1/2
    assert out["expanded"]["small"]["tokens"] == 256
    assert out["expanded"]["small"]["tflops_blocks"] == pytest.approx([4.0, 4 / 3, 2.0])
