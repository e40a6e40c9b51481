"""The write path: add, per-transaction deltas, delivery after COMMIT, durable mode, the apply."""
