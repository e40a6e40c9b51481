"""The Redis side of the pipeline, without Django: shards, scripts, leases, push ids."""
