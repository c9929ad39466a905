"""The shared experiment harness: every `python -m experiments.eNN_<claim>` uses it.

    args = parse_args("e01_fp8_gemv", __doc__)          # --quick, --out-dir, --threads
    print_ceiling("decode GEMV", bytes_moved=..., read_gbps=...)   # theoretical ceiling first
    times = interleaved_timings({"ours": f, "xla": g}, rounds=7)   # medians side by side
    emit_record(args, claim=..., paper_value=..., config=..., rows=..., summary=...)

`emit_record` writes results/<experiment>_<timestamp>.json and prints the same record as
the LAST stdout line (compact JSON).
"""

from experiments.common.models import larger_moe_config
from experiments.common.record import emit_record, environment, parse_args, print_ceiling
from experiments.common.weights import RotatingSet

# the project's one timing helper and read probe (hmoe_jax/measure/), shared with hmoe calibrate
from hmoe_jax.measure.probes import measure_read_bw
from hmoe_jax.measure.timing import TimingStats, interleaved_timings, median_time

__all__ = [
    "RotatingSet",
    "TimingStats",
    "emit_record",
    "environment",
    "interleaved_timings",
    "larger_moe_config",
    "measure_read_bw",
    "median_time",
    "parse_args",
    "print_ceiling",
]
