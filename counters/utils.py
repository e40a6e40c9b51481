from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import TypeVar, overload

K = TypeVar("K")
T = TypeVar("T")
V = TypeVar("V")

#: Most deltas a log line shows.
LOG_DELTAS = 20


def batched(iterable: Iterable[T], size: int) -> Iterator[list[T]]:
    """Lists of at most ``size`` items (``itertools.batched`` before Python 3.12)."""
    if size < 1:
        raise ValueError("size must be at least 1")
    it = iter(iterable)
    while chunk := list(islice(it, size)):
        yield chunk


def capped(items: Mapping[K, V], limit: int = LOG_DELTAS) -> dict[K, V]:
    """At most ``limit`` of ``items``, for a log line (a batch can hold thousands)."""
    return dict(islice(items.items(), limit))


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of ``exc``'s message (its type's name if empty), at most ``limit`` long."""
    lines = str(exc).strip().splitlines()
    line = lines[0] if lines else type(exc).__name__
    return line if limit is None else line[:limit]


@overload
def to_str(value: bytes | str) -> str: ...
@overload
def to_str(value: None) -> None: ...
def to_str(value: bytes | str | None) -> str | None:
    """``value`` as a str: Redis replies are bytes unless the client decodes them."""
    return value.decode() if isinstance(value, bytes) else value
