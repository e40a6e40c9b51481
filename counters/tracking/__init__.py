"""``track()``: declarations, the counted paths of tracked models, where, truth."""
