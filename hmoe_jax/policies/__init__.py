"""Request scheduling as plain data (no jax): the serving core (core.py: the request
lifecycle, the View, the decision) and the policies it asks, so the in-process scheduler
(serve/scheduler.py), the P/D coordinator (serve/pd.py) and the simulator (sim/serve.py)
run the same code on a wall clock and on a simulated one. One file per policy plus one line
in registry.py."""
