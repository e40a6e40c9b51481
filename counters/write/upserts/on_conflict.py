"""The one-statement appliers of PostgreSQL and SQLite: an upsert per batch, in key order.

Each adds ``{key: delta}`` to a counter's rows and creates the rows that are
missing in the same statement (``INSERT … ON CONFLICT (key) DO UPDATE SET
n = n + EXCLUDED.n``), so a row that another applier commits meanwhile can
never make a delta miss; rows are locked in ascending key order. Each
returns the keys it applied (a key whose parent row is gone is left out)
and the statements it ran. :mod:`counters.write.apply` picks one per vendor.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

from django.db import DataError, connections, models

from counters.base.registry import CounterSpec
from counters.base.utils import LOG_DELTAS, batched, model_field, stamped, target_field

#: Largest IN list sent in one statement (below every backend's parameter limit).
CHUNK = 5000


class Names:
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
        return [f.get_db_prep_save(new_value(f), conn) for f in self.others]

    def touches(self, conn) -> list[Any]:
        """The current time for each ``auto_now`` column, for an UPDATE's ``touch``."""
        return [f.get_db_prep_save(new_value(f), conn) for f in self.touched]

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


def new_value(field: models.Field) -> Any:
    """What ``save()`` of a new row puts in ``field``: now if it is stamped, else its default."""
    if stamped(field):
        return field.pre_save(cast(models.Model, SimpleNamespace()), True)
    return field.get_default()


def prepared(spec: CounterSpec, keyed: Mapping[Any, int], conn) -> dict[Any, Any]:
    """{db value: key}: what the database returns back, mapped to the caller's keys.

    An integer key is its own database value: the field is asked only for other types.
    """
    field = spec.key_model_field
    target = target_field(field) if field.is_relation else field
    if isinstance(target, models.IntegerField) and all(type(key) is int for key in keyed):
        return {key: key for key in keyed}
    return {field.get_db_prep_value(key, conn): key for key in keyed}


def pg_array(values: list) -> Any:
    """``values`` as a parameter for a ``%s::<type>[]`` cast: integers as an array literal.

    psycopg adapts a list element by element in Python, a fifth of a flush's
    time for batches of 5000; the literal is one string, joined in C.
    Other values (text, UUIDs) are left to psycopg, which quotes them.
    """
    if all(type(value) is int for value in values):
        return "{" + ",".join(map(str, values)) + "}"
    return values


#: Most distinct deltas a batch's UPDATE adds by ``CASE``; a batch with more joins its deltas.
CASE_DELTAS = 8

#: For the rest of the transaction: rows found by a list of keys come from the keys' index, in
#: key order (a small table is otherwise scanned whole, in physical order).
KEY_ORDER_SETTINGS = (
    "set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true)"
)
#: :data:`KEY_ORDER_SETTINGS`, returning the values they replace (for :data:`RESTORED`).
IN_KEY_ORDER = (
    "SELECT current_setting('enable_seqscan'), current_setting('enable_bitmapscan'), "
    f"{KEY_ORDER_SETTINGS}"
)
#: The settings :data:`IN_KEY_ORDER` replaced, put back (parameters: their old values).
RESTORED = (
    "SELECT set_config('enable_seqscan', %s, true), set_config('enable_bitmapscan', %s, true)"
)

#: The database alias whose current transaction runs under :data:`KEY_ORDER_SETTINGS` already.
_in_key_order: ContextVar[str | None] = ContextVar("counters_in_key_order", default=None)


@contextmanager
def in_key_order(using: str) -> Iterator[None]:
    """Declare that the transaction open on ``using`` ran :data:`KEY_ORDER_SETTINGS`: its
    batch UPDATEs within the block spare that statement (the flush sets them with its limits)."""
    token = _in_key_order.set(using)
    try:
        yield
    finally:
        _in_key_order.reset(token)


@dataclass(frozen=True)
class UpdatePlan:
    """The batch ``UPDATE`` of :func:`apply_postgresql`, built: no database round trip needed.

    The flush builds it before its turn at the database (:class:`counters.write.apply.Prepared`),
    so that the turn holds the statement's round trip and little else.
    """

    sql: str
    params: list[Any]
    #: {database value: the caller's key}, as :func:`prepared` returns.
    by_db: dict[Any, Any]
    #: Whether the statement adds by ``CASE`` (it then needs :data:`KEY_ORDER_SETTINGS`).
    by_case: bool


def plan_postgresql(spec: CounterSpec, keyed: Mapping[Any, int], conn) -> UpdatePlan:
    """The :class:`UpdatePlan` adding ``keyed`` (nonzero deltas) to ``spec``'s rows on ``conn``."""
    n = Names(spec, conn)
    by_db = prepared(spec, keyed, conn)
    keys = sorted(by_db)
    by_delta: dict[int, list[Any]] = {}
    for db_key in keys:
        by_delta.setdefault(keyed[by_db[db_key]], []).append(db_key)
    touches = n.touches(conn)
    by_delta_case = len(by_delta) <= CASE_DELTAS and binds_on_client(conn)
    if by_delta_case:
        ctes, params = _by_case(n, by_delta, keys, touches)
    else:
        ctes, params = _joined(n, keyed, by_db, keys, touches)
    sql = f"WITH {ctes} SELECT count(*), CASE WHEN count(*) < %s THEN array_agg(u.k) END FROM u"
    return UpdatePlan(sql, [*params, len(by_db)], by_db, by_delta_case)


def apply_postgresql(
    spec: CounterSpec, keyed: Mapping[Any, int], using: str, plan: UpdatePlan | None = None
) -> tuple[set, int]:
    """One additive ``UPDATE`` per batch; the upsert for the rows it missed.

    Nearly every key of a flush has its row already, and an additive UPDATE
    of them is the cheapest statement there is (no parent probe, no
    speculative insertion): it returns how many rows it changed, and their
    keys only when that is fewer than the batch's. The keys it missed go
    through :func:`upsert_postgresql`, which creates them, or adds to them if
    another applier created them meanwhile, or drops them if their parent
    row is gone.

    A batch's deltas take few values (mostly 1 and -1), so the UPDATE selects
    its rows by ``= ANY`` of the batch's keys, an index scan that locks them
    in key order, and adds each row's delta by a ``CASE`` over the keys of
    each value (PostgreSQL hashes a constant array of 9 or more). That is the
    raw bound's work in one statement, cheaper than joining ``unnest()`` of
    the keys and deltas, which a batch of more than :data:`CASE_DELTAS`
    distinct deltas still does (:func:`_joined`), as does a connection that
    binds parameters on the server (:func:`binds_on_client`). Both lock the rows in key
    order, as the upsert does.

    ``plan`` is the statement built beforehand by :func:`plan_postgresql` for these
    ``keyed``; without it, it is built here.
    """
    conn = connections[using]
    if plan is None:
        plan = plan_postgresql(spec, keyed, conn)
    by_db = plan.by_db
    with conn.cursor() as cursor:
        replaced = None
        if plan.by_case and _in_key_order.get() != using:
            cursor.execute(IN_KEY_ORDER)
            replaced = cursor.fetchone()[:2]
        cursor.execute(plan.sql, plan.params)
        changed, found = cursor.fetchone()
        if replaced is not None:  # the caller's transaction, if it goes on, plans as it did
            cursor.execute(RESTORED, list(replaced))
    if changed == len(by_db):
        return set(keyed), 1
    missing = set(by_db).difference(found or ())
    created, statements = upsert_postgresql(
        spec, {by_db[k]: keyed[by_db[k]] for k in missing}, using
    )
    return {by_db[k] for k in by_db if k not in missing} | created, 1 + statements


def binds_on_client(conn) -> bool:
    """Whether parameters reach PostgreSQL inside the SQL text: psycopg 2, and psycopg 3
    unless ``OPTIONS["server_side_binding"]``.

    The ``CASE`` of :func:`_by_case` hashes its arrays when they are constants. Bound on the
    server, the batch UPDATE by ``CASE`` took 1.0 s against the join's 0.71 s (32 batches of
    5000 keys): its arrays arrive as parameters, which a prepared statement's generic plan
    likely cannot hash.
    """
    return not (conn.settings_dict.get("OPTIONS") or {}).get("server_side_binding")


def _by_case(
    n: Names, by_delta: Mapping[int, list[Any]], keys: list[Any], touches: list[Any]
) -> tuple[str, list]:
    """The UPDATE of ``keys`` (sorted) adding one of a few deltas by ``CASE``, as CTE ``u``,
    and its parameters. The largest group of keys is the ``ELSE``: no lookup.

    The rows are found by ``= ANY`` of the keys, which must be an index scan
    to lock them in key order: a scan of the whole table, or of a bitmap,
    goes in the table's physical order. Both are off for the statement
    (:data:`KEY_ORDER_SETTINGS`: for the flush's whole apply transaction, else
    around the statement); and the array is one the planner
    cannot see into (``ARRAY(SELECT unnest(…))``), so that it expects a few
    keys, as with the join.
    """
    *cases, (last, _) = sorted(by_delta.items(), key=lambda group: len(group[1]))
    whens = "".join(f"WHEN t.{n.key} = ANY(%s::{n.key_type}[]) THEN %s::bigint " for _ in cases)
    params: list[Any] = []
    for delta, group in cases:
        params += [pg_array(group), delta]
    added = f"CASE {whens}ELSE %s::bigint END" if cases else "%s::bigint"
    sql = (
        f"u AS (UPDATE {n.table} AS t SET {n.value} = t.{n.value} + {added}{n.touch} "
        f"WHERE t.{n.key} = ANY(ARRAY(SELECT unnest(%s::{n.key_type}[]))) "
        f"RETURNING t.{n.key} AS k)"
    )
    return sql, [*params, last, *touches, pg_array(keys)]


def _joined(
    n: Names,
    keyed: Mapping[Any, int],
    by_db: Mapping[Any, Any],
    keys: list[Any],
    touches: list[Any],
) -> tuple[str, list]:
    """The UPDATE joining ``unnest()`` of the keys and their deltas, as CTE ``u``, and its
    parameters.

    The ``= ANY`` of the keys makes the rows an index scan of just those
    keys, whatever the table's statistics say (a join alone hashes the whole
    table when the planner thinks it small). The planner then expects few
    rows from it: it hashes them and runs the join over the sorted keys, so
    rows are locked in key order as in the upsert.
    """
    sql = (
        f"d AS MATERIALIZED (SELECT k, n FROM unnest(%s::{n.key_type}[], %s::bigint[]) "
        f"AS d(k, n) ORDER BY k), "
        f"u AS (UPDATE {n.table} AS t SET {n.value} = t.{n.value} + d.n{n.touch} FROM d "
        f"WHERE t.{n.key} = d.k AND t.{n.key} = ANY(ARRAY(SELECT k FROM d)) "
        f"RETURNING t.{n.key} AS k)"
    )
    return sql, [pg_array(keys), pg_array([keyed[by_db[k]] for k in keys]), *touches]


def upsert_postgresql(spec: CounterSpec, keyed: Mapping[Any, int], using: str) -> tuple[set, int]:
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
    n = Names(spec, conn)
    by_db = prepared(spec, keyed, conn)
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
        deltas = pg_array([keyed[by_db[k]] for k in keys])
        cursor.execute(sql, [*n.defaults(conn), pg_array(keys), deltas])
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


def apply_sqlite(spec: CounterSpec, keyed: Mapping[Any, int], using: str) -> tuple[set, int]:
    """The same upsert from a VALUES list (SQLite ≥ 3.35 for RETURNING).

    SQLite has one writer at a time, so nothing can change between the join
    and COMMIT. ``WHERE true`` resolves SQLite's parsing ambiguity between a
    join's ON and the upsert's ON CONFLICT.
    """
    conn = connections[using]
    n = Names(spec, conn)
    by_db = prepared(spec, keyed, conn)
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


def capped_keys(keys: list) -> str:
    return ", ".join(str(k) for k in keys[:LOG_DELTAS])
