"""The read path: stored plus buffered values."""
