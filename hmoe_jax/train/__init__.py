"""Training the shipped DeepSeek-V3-architecture default model (docs/training.md):
`data` (stdlib corpus, BPE, batches), `recipe` (architecture + hyperparameters), `loop`
(optax training through the repo's model blocks, aux-loss-free balancing), `export`
(DeepSeek FP8 release format)."""
