"""The engine: plans from hmoe_jax.schedules run by hmoe_jax.runtime (the one package that
sees both)."""
