from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import TypeVar

T = TypeVar("T")


def batched(iterable: Iterable[T], size: int) -> Iterator[list[T]]:
    """Lists of at most ``size`` items (``itertools.batched`` before Python 3.12)."""
    if size < 1:
        raise ValueError("size must be at least 1")
    it = iter(iterable)
    while chunk := list(islice(it, size)):
        yield chunk
