"""Serving: the request API (request.py), the in-process request scheduler (scheduler.py)
that runs a policy (hmoe_jax.policies) on the engine, and intra-node prefill/decode
disaggregation across processes (pd.py)."""
