"""Apply deltas to counter rows: one upsert per batch, rows locked in key order.

Every applier (a flush, a direct write when Redis is down) creates and
updates a counter row in the same statement, ``INSERT … ON CONFLICT (key) DO
UPDATE SET n = n + EXCLUDED.n``, so a row that another applier commits
meanwhile can never make a delta miss. Rows are locked in ascending key order
in every statement, so concurrent appliers queue on each other and never
deadlock. Deltas whose foreign-key target row is gone are dropped and counted.
"""

from __future__ import annotations

import logging
import sqlite3
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

from django.db import (
    DataError,
    InterfaceError,
    InternalError,
    OperationalError,
    ProgrammingError,
    connections,
    models,
    transaction,
)
from django.db.transaction import TransactionManagementError

from . import tombs
from .registry import CounterSpec, get_spec
from .utils import LOG_DELTAS, batched, first_line, model_field, stamped, target_field

logger = logging.getLogger(__name__)

#: Largest IN list sent in one statement (below every backend's parameter limit).
CHUNK = 5000

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


class _Names:
    """Quoted table and column names of one counter on one connection."""

    def __init__(self, spec: CounterSpec, conn) -> None:
        qn = conn.ops.quote_name
        meta = spec.model._meta
        field = spec.key_model_field
        self.table = qn(meta.db_table)
        self.key = qn(field.column)
        self.value = qn(model_field(spec.model, spec.value_field).column)
        # The key's column type, for the array cast (an AutoField's is "integer").
        self.key_type = field.db_type(conn) if field.is_relation else field.rel_db_type(conn)
        self.parent = self.parent_key = None
        if spec.target_model is not None:
            self.parent = qn(spec.target_model._meta.db_table)
            self.parent_key = qn(target_field(field).column)
        # A row may hold several counters: a new one gets the other columns' defaults,
        # and the current time in its auto_now and auto_now_add columns, as save() does.
        value_field = meta.get_field(spec.value_field)
        self.others = [
            f
            for f in meta.concrete_fields
            if f not in (field, value_field)
            and (stamped(f) or (f.has_default() and not f.has_db_default()))
            and not getattr(f, "generated", False)
        ]
        self.other_columns = "".join(f", {qn(f.column)}" for f in self.others)
        self.other_params = ", %s" * len(self.others)
        self.other_casts = "".join(f", %s::{f.cast_db_type(conn)}" for f in self.others)
        # auto_now columns move on with every change of the row, as with save().
        self.touched = [f for f in self.others if getattr(f, "auto_now", False)]
        self.touch = "".join(f", {qn(f.column)} = %s" for f in self.touched)
        self.touch_excluded = "".join(
            f", {qn(f.column)} = EXCLUDED.{qn(f.column)}" for f in self.touched
        )

    def defaults(self, conn) -> list[Any]:
        """The other columns' values for a new row (see ``others``)."""
        return [f.get_db_prep_save(_new_value(f), conn) for f in self.others]

    def touches(self, conn) -> list[Any]:
        """The current time for each ``auto_now`` column, for an UPDATE's ``touch``."""
        return [f.get_db_prep_save(_new_value(f), conn) for f in self.touched]

    def join(self, key: str, lateral: bool = False) -> str:
        """Inner join of the parent table: keys whose parent row is gone drop out.

        ``lateral`` makes PostgreSQL probe the parent's index once per key: as a
        plain join it hashes the whole parent table for every batch.
        """
        if self.parent is None:
            return ""
        if lateral:
            return (
                f"CROSS JOIN LATERAL (SELECT 1 FROM {self.parent} AS p "
                f"WHERE p.{self.parent_key} = {key} OFFSET 0) AS p "
            )
        return f"JOIN {self.parent} AS p ON p.{self.parent_key} = {key} "


def _new_value(field: models.Field) -> Any:
    """What ``save()`` of a new row puts in ``field``: now if it is stamped, else its default."""
    if stamped(field):
        return field.pre_save(cast(models.Model, SimpleNamespace()), True)
    return field.get_default()


def _prepared(spec: CounterSpec, keyed: Mapping[Any, int], conn) -> dict[Any, Any]:
    """{db value: key}: what the database returns back, mapped to the caller's keys.

    An integer key is its own database value: the field is asked only for other types.
    """
    field = spec.key_model_field
    target = target_field(field) if field.is_relation else field
    if isinstance(target, models.IntegerField) and all(type(key) is int for key in keyed):
        return {key: key for key in keyed}
    return {field.get_db_prep_value(key, conn): key for key in keyed}


def _apply_postgresql(spec: CounterSpec, keyed: Mapping[Any, int], using: str) -> tuple[set, int]:
    """One ``UPDATE … FROM unnest(keys, deltas)`` per batch; the upsert for rows it missed.

    Nearly every key of a flush has its row already, and an additive UPDATE
    of them is the cheapest statement there is (no parent probe, no
    speculative insertion, nothing sent back): the statement returns only
    the keys whose row it did not find. Those go through
    :func:`_upsert_postgresql`, which creates them, or adds to them if
    another applier created them meanwhile, or drops them if their parent row
    is gone.

    The ``= ANY`` of the keys makes the rows an index scan of just those
    keys, whatever the table's statistics say (a join alone hashes the whole
    table when the planner thinks it small). The planner then expects few
    rows from it: it hashes them and runs the join over the sorted keys, so
    rows are locked in key order as in the upsert.
    """
    conn = connections[using]
    n = _Names(spec, conn)
    by_db = _prepared(spec, keyed, conn)
    keys = sorted(by_db)
    sql = (
        f"WITH d AS MATERIALIZED (SELECT k, n FROM unnest(%s::{n.key_type}[], %s::bigint[]) "
        f"AS d(k, n) ORDER BY k), "
        f"u AS (UPDATE {n.table} AS t SET {n.value} = t.{n.value} + d.n{n.touch} FROM d "
        f"WHERE t.{n.key} = d.k AND t.{n.key} = ANY(ARRAY(SELECT k FROM d)) "
        f"RETURNING t.{n.key} AS k) "
        f"SELECT d.k FROM d WHERE NOT EXISTS (SELECT 1 FROM u WHERE u.k = d.k)"
    )
    with conn.cursor() as cursor:
        cursor.execute(sql, [keys, [keyed[by_db[k]] for k in keys], *n.touches(conn)])
        missing = [by_db[k] for (k,) in cursor.fetchall()]
    if not missing:
        return set(keyed), 1
    created, statements = _upsert_postgresql(spec, {k: keyed[k] for k in missing}, using)
    return set(keyed) - set(missing) | created, 1 + statements


def _upsert_postgresql(spec: CounterSpec, keyed: Mapping[Any, int], using: str) -> tuple[set, int]:
    """One ``INSERT … SELECT FROM unnest(keys, deltas) … ON CONFLICT DO UPDATE``.

    The arrays spare a SQL text with a placeholder per key. ``ORDER BY`` makes
    the statement lock (or create) rows in key order. RETURNING tells which
    keys were applied: a key whose parent row is not visible is left out by
    the join. A parent deleted by a transaction that commits after the
    statement began is still joined, and its new counter row would fail the
    deferred foreign-key check at COMMIT, taking every other delta of the
    batch with it; so the parents of the rows just created are locked (as
    that check would) and the rows of any that are gone are deleted again.
    Rows that already existed need no check: deleting their parent deletes
    them too.
    """
    conn = connections[using]
    n = _Names(spec, conn)
    by_db = _prepared(spec, keyed, conn)
    keys = sorted(by_db)
    sql = (
        f"INSERT INTO {n.table} AS t ({n.key}, {n.value}{n.other_columns}) "
        f"SELECT d.k, d.n{n.other_casts} FROM unnest(%s::{n.key_type}[], %s::bigint[]) AS d(k, n) "
        f"{n.join('d.k', lateral=True)}ORDER BY d.k "
        f"ON CONFLICT ({n.key}) DO UPDATE SET {n.value} = t.{n.value} + EXCLUDED.{n.value}"
        f"{n.touch_excluded} "
        # xmax is 0 in a row version this statement inserted, not in one it updated.
        f"RETURNING t.{n.key}, t.xmax = 0"
    )
    statements = 1
    with conn.cursor() as cursor:
        cursor.execute(sql, [*n.defaults(conn), keys, [keyed[by_db[k]] for k in keys]])
        rows = cursor.fetchall()
        applied = {k for k, _ in rows}
        created = sorted(k for k, inserted in rows if inserted)
        if created and n.parent is not None:
            cursor.execute(
                f"SELECT {n.parent_key} FROM {n.parent} "
                f"WHERE {n.parent_key} = ANY(%s::{n.key_type}[]) "
                f"ORDER BY {n.parent_key} FOR KEY SHARE",
                [created],
            )
            gone = set(created) - {k for (k,) in cursor.fetchall()}
            statements += 1
            if gone:
                cursor.execute(
                    f"DELETE FROM {n.table} WHERE {n.key} = ANY(%s::{n.key_type}[])",
                    [sorted(gone)],
                )
                applied -= gone
                statements += 1
    return {by_db[k] for k in applied}, statements


def _apply_sqlite(spec: CounterSpec, keyed: Mapping[Any, int], using: str) -> tuple[set, int]:
    """The same upsert from a VALUES list (SQLite ≥ 3.35 for RETURNING).

    SQLite has one writer at a time, so nothing can change between the join
    and COMMIT. ``WHERE true`` resolves SQLite's parsing ambiguity between a
    join's ON and the upsert's ON CONFLICT.
    """
    conn = connections[using]
    n = _Names(spec, conn)
    by_db = _prepared(spec, keyed, conn)
    conn.ensure_connection()
    limit = conn.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    applied: set = set()
    statements = 0
    defaults = n.defaults(conn)
    with conn.cursor() as cursor:
        for chunk in batched(sorted(by_db), max(1, min(CHUNK, (limit - len(defaults)) // 2))):
            values = ", ".join(["(%s, %s)"] * len(chunk))
            cursor.execute(
                f"INSERT INTO {n.table} ({n.key}, {n.value}{n.other_columns}) "
                f"SELECT d.column1, d.column2{n.other_params} "
                f"FROM (VALUES {values}) AS d "
                f"{n.join('d.column1')}WHERE true ORDER BY d.column1 "
                f"ON CONFLICT ({n.key}) DO UPDATE SET {n.value} = {n.value} + excluded.{n.value}"
                f"{n.touch_excluded} RETURNING {n.key}, typeof({n.value})",
                [*defaults, *(p for k in chunk for p in (k, keyed[by_db[k]]))],
            )
            rows = cursor.fetchall()
            beyond = sorted(k for k, kind in rows if kind != "integer")
            if beyond:
                # SQLite turns an integer that overflows into an inexact float: refuse it
                # as PostgreSQL does (the caller's transaction rolls the statement back).
                raise DataError(
                    f"integer out of range: {spec.name} at {capped_keys(beyond)} would leave "
                    "the 64-bit range of its column"
                )
            applied.update(k for k, _ in rows)
            statements += 1
    return {by_db[k] for k in applied}, statements


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
        f.attname: _new_value(f)
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
    "postgresql": _apply_postgresql,
    "sqlite": _apply_sqlite,
}


def apply_spec(spec: CounterSpec, keyed: Mapping[Any, int], using: str) -> Applied:
    """Add ``keyed`` ({key: delta}) to ``spec``'s rows. Call inside a transaction.

    Missing rows are created with their delta, unless the row they count for
    is gone: those deltas are dropped.
    """
    keyed = {k: d for k, d in keyed.items() if d}
    if not keyed:
        return Applied(keys=0, deltas=0, dropped=0, statements=0)
    applier = APPLIERS.get(connections[using].vendor, _apply_generic)
    applied, statements = applier(spec, keyed, using)
    dropped = [k for k in keyed if k not in applied]
    if tombs.reusable(spec):
        # A natural key may come back: what its deleted parent was owed is kept for it,
        # and taken in by the row of a parent created again.
        if dropped:
            tombs.keep(spec, {k: keyed[k] for k in dropped}, using)
        if applied:
            tombs.fold(spec, sorted(applied), using)
    if dropped:
        logger.warning(
            "dropped deltas of %s vanished %s keys: %s",
            len(dropped),
            spec.name,
            sorted(dropped)[:LOG_DELTAS],
        )
    return Applied(
        keys=len(keyed) - len(dropped),
        deltas=sum(abs(d) for k, d in keyed.items() if k in applied),
        dropped=len(dropped),
        statements=statements,
    )


def capped_keys(keys: list) -> str:
    return ", ".join(str(k) for k in keys[:LOG_DELTAS])


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
    return Applied(keys, total, dropped, statements), refused


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
    """Apply {member: delta} across every counter named in the members."""
    keys = total = dropped = statements = 0
    for spec, keyed in group_by_spec(deltas).items():
        applied = apply_spec(spec, keyed, using)
        keys += applied.keys
        total += applied.deltas
        dropped += applied.dropped
        statements += applied.statements
    return Applied(keys, total, dropped, statements)
