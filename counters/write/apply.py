"""Apply deltas to counter rows: one upsert per batch, rows locked in key order.

Every applier (a flush, a direct write when Redis is down) creates and
updates a counter row in the same statement, ``INSERT … ON CONFLICT (key) DO
UPDATE SET n = n + EXCLUDED.n``, so a row that another applier commits
meanwhile can never make a delta miss. Rows are locked in ascending key order
in every statement, so concurrent appliers queue on each other and never
deadlock. Deltas whose foreign-key target row is gone are dropped and counted
(and, for a counter keyed by a natural key, kept: :mod:`counters.write.natural_keys`).

The statements of PostgreSQL and SQLite are in :mod:`counters.write.upserts.on_conflict`,
those of MySQL and MariaDB in :mod:`counters.write.upserts.mysql` (``ON DUPLICATE
KEY UPDATE``); any other database gets the generic applier here.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from django.db import (
    InterfaceError,
    InternalError,
    OperationalError,
    ProgrammingError,
    connections,
    models,
    transaction,
)
from django.db.transaction import TransactionManagementError

from counters.base.registry import CounterSpec, get_spec
from counters.base.utils import LOG_DELTAS, batched, first_line
from counters.write import natural_keys
from counters.write.changes import Changes, merge
from counters.write.upserts.composite import apply_composite
from counters.write.upserts.mysql import apply_mysql
from counters.write.upserts.on_conflict import (
    CHUNK,
    UpdatePlan,
    apply_postgresql,
    apply_sqlite,
    new_value,
    plan_postgresql,
)

logger = logging.getLogger(__name__)

#: Errors of the database rather than of the deltas applied: applying them again later may work.
DATABASE_ERRORS: tuple[type[Exception], ...] = (
    OperationalError,  # connection lost, deadlock, lock or statement timeout, no such table
    ProgrammingError,  # a counter table or column renamed or missing (a migration under way)
    InterfaceError,  # connection closed
    InternalError,  # read-only transaction (a failover to a replica), aborted transaction
    TransactionManagementError,
)


@dataclass(frozen=True)
class Applied:
    keys: int
    deltas: int
    dropped: int
    statements: int
    #: What changed in counter rows, {counter name: {key: delta}} (``counters.signals.applied``).
    changes: Changes = field(default_factory=dict)


def group_by_spec(deltas: Mapping[str, int]) -> dict[CounterSpec, dict[Any, int]]:
    """{spec: {typed key: delta}} from {"<name>:<key>": delta} (the flush's hot loop)."""
    grouped: dict[CounterSpec, dict[Any, int]] = {}
    by_name: dict[str, tuple[dict[Any, int], Callable[[Any], Any]]] = {}
    for member, delta in deltas.items():
        if not delta:
            continue
        name, _, raw_key = member.partition(":")
        entry = by_name.get(name)
        if entry is None:
            spec = get_spec(name)
            entry = by_name[name] = (grouped.setdefault(spec, {}), spec.to_key)
        keyed, to_key = entry
        key = to_key(raw_key)
        keyed[key] = keyed.get(key, 0) + delta
    return grouped


class Prepared(dict[str, int]):
    """A batch's deltas ({member: delta}), with what applying them needs that is not the database's.

    :func:`prepare_deltas` groups the members by counter and, on PostgreSQL, builds
    each counter's batch ``UPDATE`` (:class:`counters.write.upserts.on_conflict.UpdatePlan`).
    The flush prepares a batch before it takes its turn at the database, so
    that the turn holds the round trips and little Python.
    :func:`apply_deltas` takes it as any other mapping of deltas. It is the
    deltas it was made from, unchanged, for whoever reads it as a dict.
    """

    using: str
    #: {spec: {typed key: nonzero delta}}, as :func:`group_by_spec` returns, zeros left out;
    #: :class:`Planned` where the statement could be built beforehand.
    grouped: dict[CounterSpec, dict[Any, int]]


class Planned(dict[Any, int]):
    """One counter's {typed key: nonzero delta}, with the statement that adds them (``plan``)."""

    plan: UpdatePlan


def prepare_deltas(deltas: Mapping[str, int], using: str) -> Prepared:
    """``deltas`` ({member: delta}) as a :class:`Prepared` batch for database ``using``.

    Raises as :func:`apply_deltas` would for a member it cannot read (an unknown
    counter, a key of the wrong type): the caller isolates the batch as it would then.
    """
    batch = Prepared(deltas)
    batch.using = using
    conn = connections[using]
    plans = conn.vendor == "postgresql"
    batch.grouped = {}
    for spec, keyed in group_by_spec(deltas).items():
        nonzero = Planned((k, d) for k, d in keyed.items() if d)
        if plans and nonzero and spec.codec is None:
            nonzero.plan = plan_postgresql(spec, nonzero, conn)
        batch.grouped[spec] = nonzero
    return batch


def _alive(spec: CounterSpec, keys: list, using: str) -> set:
    """Keys whose foreign-key target row still exists (all keys if not a foreign key)."""
    target = spec.target_model
    if target is None:
        return set(keys)
    to_field: str = cast(Any, spec.key_model_field.remote_field).field_name
    alive: set = set()
    for chunk in batched(keys, CHUNK):
        alive.update(
            target._default_manager.using(using)
            .filter(**{f"{to_field}__in": chunk})
            .values_list(to_field, flat=True)
        )
    return alive


def _apply_generic(spec: CounterSpec, keyed: Mapping[Any, int], using: str) -> tuple[set, int]:
    """Any other database: lock, create what is missing, then add. Race-free, not fast.

    The existing rows are locked first, in key order (``SELECT … FOR UPDATE``).
    The missing rows whose parent exists are then created at 0, ignoring
    conflicts with rows another applier created meanwhile. Only then come
    the additive UPDATEs, so every one of them finds its row.
    """
    qs = spec.model._default_manager.using(using)
    attname, value = spec.key_attname, spec.value_field
    keys = sorted(keyed)
    existing: set = set()
    statements = 0
    for chunk in batched(keys, CHUNK):
        existing.update(
            qs.select_for_update()
            .filter(**{f"{attname}__in": chunk})
            .order_by(attname)
            .values_list(attname, flat=True)
        )
        statements += 1
    missing = [k for k in keys if k not in existing]
    created: list = []
    if missing:
        created = sorted(_alive(spec, missing, using))
        if spec.target_model is not None:
            statements += -(-len(missing) // CHUNK)
    if created:
        qs.bulk_create(
            [spec.model(**{attname: k, value: 0}) for k in created],
            ignore_conflicts=True,
            batch_size=CHUNK,
        )
        statements += -(-len(created) // CHUNK)
    applied = existing | set(created)
    by_delta: dict[int, list] = defaultdict(list)
    for key in sorted(applied):
        by_delta[keyed[key]].append(key)
    touch = {
        f.attname: new_value(f)
        for f in spec.model._meta.concrete_fields
        if getattr(f, "auto_now", False)
    }
    for delta, group in sorted(by_delta.items()):
        for chunk in batched(group, CHUNK):
            qs.filter(**{f"{attname}__in": chunk}).update(
                **{value: models.F(value) + delta}, **touch
            )
            statements += 1
    return applied, statements


#: The applier of each database vendor; any other gets the generic one.
APPLIERS: dict[str, Callable[[CounterSpec, Mapping[Any, int], str], tuple[set, int]]] = {
    "postgresql": apply_postgresql,
    "sqlite": apply_sqlite,
    "mysql": apply_mysql,
}


def apply_spec(spec: CounterSpec, keyed: Mapping[Any, int], using: str) -> Applied:
    """Add ``keyed`` ({key: delta}) to ``spec``'s rows. Call inside a transaction.

    Missing rows are created with their delta, unless the row they count for
    is gone: those deltas are dropped. ``keyed`` may be :class:`Planned` (by
    :func:`prepare_deltas`): its statement is run as built.
    """
    plan: UpdatePlan | None
    nonzero: dict[Any, int]
    if isinstance(keyed, Planned):  # zeros left out already
        plan, nonzero = getattr(keyed, "plan", None), keyed
    else:
        plan, nonzero = None, {k: d for k, d in keyed.items() if d}
    if not nonzero:
        return Applied(keys=0, deltas=0, dropped=0, statements=0)
    if plan is not None:
        applied, statements = apply_postgresql(spec, nonzero, using, plan)
    else:
        applier = APPLIERS.get(connections[using].vendor, _apply_generic)
        if spec.codec is not None:  # a composite key: its own upsert over its columns
            applier = apply_composite
        applied, statements = applier(spec, nonzero, using)
    dropped = [] if applied.issuperset(nonzero) else [k for k in nonzero if k not in applied]
    folded: dict[Any, int] = {}
    if natural_keys.reusable(spec):
        # A natural key may come back: what its deleted parent was owed is kept for it,
        # and taken in by the row of a parent created again.
        if dropped:
            natural_keys.keep(spec, {k: nonzero[k] for k in dropped}, using)
        if applied:
            folded = natural_keys.fold(spec, sorted(applied), using)
    if dropped:
        logger.warning(
            "dropped deltas of %s vanished %s keys: %s",
            len(dropped),
            spec.name,
            sorted(dropped)[:LOG_DELTAS],
        )
    changed = {k: d for k, d in nonzero.items() if k in applied} if dropped else nonzero
    rows = changed
    if folded:  # what the rows changed by: the deltas and the tombstones folded into them
        rows = dict(changed)
        for key, value in folded.items():
            rows[key] = rows.get(key, 0) + value
        rows = {k: d for k, d in rows.items() if d}
    return Applied(
        keys=len(nonzero) - len(dropped),
        deltas=sum(map(abs, changed.values())),
        dropped=len(dropped),
        statements=statements,
        changes={spec.name: rows} if rows else {},
    )


def apply_isolating(
    deltas: Mapping[str, int], using: str
) -> tuple[Applied, dict[str, tuple[int, str]]]:
    """:func:`apply_deltas`, leaving out each member the database refuses on its own.

    Returns what was applied and ``{member: (delta, error)}`` of the deltas
    that cannot be applied (a value beyond the column's range, an unknown
    counter), for the quarantine. Errors of the database itself
    (:data:`DATABASE_ERRORS`) are raised. Call inside a transaction: each
    attempt runs in a savepoint of its own.
    """
    whole = _attempt(deltas, using)
    if isinstance(whole, Applied):
        return whole, {}
    if len(deltas) == 1:
        return Applied(0, 0, 0, 0), {member: (d, whole) for member, d in deltas.items()}
    keys = total = dropped = statements = 0
    changes: Changes = {}
    refused: dict[str, tuple[int, str]] = {}
    for member, delta in sorted(deltas.items()):
        part = _attempt({member: delta}, using)
        if not isinstance(part, Applied):
            refused[member] = (delta, part)
            continue
        keys += part.keys
        total += part.deltas
        dropped += part.dropped
        statements += part.statements
        merge(changes, part.changes)
    return Applied(keys, total, dropped, statements, changes), refused


def _attempt(deltas: Mapping[str, int], using: str) -> Applied | str:
    """:func:`apply_deltas` in a savepoint; the error line if the deltas were refused."""
    try:
        with transaction.atomic(using=using):
            return apply_deltas(deltas, using)
    except DATABASE_ERRORS:
        raise
    except Exception as exc:
        return f"{type(exc).__name__}: {first_line(exc)}"[:200]


def apply_deltas(deltas: Mapping[str, int], using: str) -> Applied:
    """Apply {member: delta} across every counter named in the members.

    ``deltas`` may be :class:`Prepared` for ``using``: its grouping and statements are used.
    """
    keys = total = dropped = statements = 0
    changes: Changes = {}
    if isinstance(deltas, Prepared) and deltas.using == using:
        grouped = deltas.grouped
    else:
        grouped = group_by_spec(deltas)
    for spec, keyed in grouped.items():
        applied = apply_spec(spec, keyed, using)
        keys += applied.keys
        total += applied.deltas
        dropped += applied.dropped
        statements += applied.statements
        changes.update(applied.changes)  # one entry per counter
    return Applied(keys, total, dropped, statements, changes)
