"""Request-scheduling policies: plain data in, plain data out (no jax), so the in-process
scheduler (serve/scheduler.py) and the simulator (sim/) run the same policy code on a wall
clock and on a simulated one. One file per policy plus one line in registry.py."""
