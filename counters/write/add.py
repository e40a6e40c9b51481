"""``add()`` and ``add_many()``: deltas recorded now, sent once the transaction commits.

The entry of the write path. A delta is normalised to its member
(``"<counter name>:<key>"``) and recorded on the current transaction
(:mod:`counters.write.transactions`), with who delivers it after the COMMIT:
:func:`counters.write.delivery.send`, and in durable mode the outbox hook
(:mod:`counters.write.durable`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import DEFAULT_DB_ALIAS

from counters.base.registry import get_spec
from counters.write import delivery, durable, transactions


def add(name: str, key: Any, delta: int = 1, *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Add ``delta`` to counter ``name`` at ``key`` once the current transaction commits.

    Raises :class:`InvalidKey` if ``key`` is not a valid key of the counter.
    """
    add_many(name, {key: delta}, using=using)


def add_many(name: str, deltas: Mapping[Any, int], *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Add several deltas ({key: delta}) to counter ``name`` after commit.

    Keys are normalised first (``"7"`` and ``7`` are one key, their deltas
    add up); a key that is not valid raises :class:`InvalidKey` and nothing
    of the call is recorded.
    """
    spec = get_spec(name)
    members: dict[str, int] = {}
    for key, delta in deltas.items():
        member = spec.member(key)
        members[member] = members.get(member, 0) + delta
    add_members(members, using=using)


def add_members(members: Mapping[str, int], *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Add deltas given per Redis member (``"<name>:<normalised key>"``, as
    :meth:`CounterSpec.member <counters.base.registry.CounterSpec.member>` makes
    them) after commit; zeros are left out. The counted paths' entry."""
    if all(members.values()):
        changed = dict(members)
    else:
        changed = {member: delta for member, delta in members.items() if delta}
    if changed:
        transactions.record(changed, using, delivery.send, durable.hook)


def add_made(members: dict[str, int], using: str) -> None:
    """:func:`add_members` of a dict made for this call alone (the caller keeps no reference
    to it): recorded without a copy when it holds no zero."""
    if members and all(members.values()):
        transactions.record(members, using, delivery.send, durable.hook)
    else:
        add_members(members, using=using)
