"""The base layer: settings, exceptions, the counter registry, helpers, switches, metrics."""
