"""Measurement code: what this machine's kernels, copies and compiled pieces cost, read
SIDE BY SIDE with a DRAM read probe (this VM's read rate moves by 2x within minutes).

- probes.py: the DRAM read probe (hmoe_read_bytes over 1 GiB) and the bf16 peak probe;
- timing.py: median-of-runs timing and side-by-side timing against a probe;
- stacks.py: random real-shape FP8 / INT4 expert stacks, zero-copy, for the kernel probes;
- calibrate.py: `hmoe calibrate`'s measurements (expert kernel, copies, engine overheads);
- standin.py: the stand-in accelerator's rates (GEMM, FP8 convert, prefill attention);
- local_profile.py: the measurements written as a simulator profile (local.toml);
- compile_probe.py: compile-only memory/cost of the engine's pieces at real shapes (`hmoe plan`).
- gpu_profile.py: the GPU half of a profile (link, GEMMs, memory, attention, op overhead) over
  a CPU-side base profile of the same host (tools/gpu_calibrate.py, tools/gpu_check.py).
"""
