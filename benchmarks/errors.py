"""The bench's own error: the run cannot go on, and the message says why in one line."""


class BenchError(RuntimeError):
    """The bench cannot run or a measurement went wrong."""
