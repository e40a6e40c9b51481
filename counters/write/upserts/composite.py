"""The applier of counters with a composite key: an upsert over the key's columns.

``INSERT … VALUES … ON CONFLICT (part, part) DO UPDATE SET n = n + EXCLUDED.n``
on PostgreSQL and SQLite, ``ON DUPLICATE KEY UPDATE`` on MySQL and MariaDB,
over the unique constraint ``track()`` requires. Rows go in ascending key
order, so concurrent appliers queue instead of deadlocking. A key whose
foreign-key parent row is gone is dropped: the parents are read first, and on
PostgreSQL and MySQL locked in share mode until COMMIT, so none can go before
the new counter rows are committed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from django.db import DataError, connections, models

from counters.base.keys import KeyCodec
from counters.base.registry import CounterSpec
from counters.base.utils import batched, model_field, on_duplicate_key, stamped, target_field
from counters.write.upserts.on_conflict import capped_keys, new_value

#: Keys per statement (a few parameters each: below every backend's limit).
ROWS = 500

#: The vendors with an upsert statement here; any other gets the ORM path.
NATIVE = ("postgresql", "sqlite", "mysql")

#: How each vendor locks the parent rows read (until COMMIT), so none is deleted meanwhile.
SHARE_LOCKS = {"postgresql": " FOR KEY SHARE", "mysql": " LOCK IN SHARE MODE"}


def apply_composite(spec: CounterSpec, keyed: Mapping[Any, int], using: str) -> tuple[set, int]:
    """Add ``keyed`` ({CompositeKey: delta}) to ``spec``'s rows; returns the keys applied
    and the statements run."""
    conn = connections[using]
    codec = cast(KeyCodec, spec.codec)
    keys = sorted(keyed)
    alive, statements = _alive(codec, keys, conn)
    applied = [key for key in keys if key in alive]
    if conn.vendor not in NATIVE:
        return set(applied), statements + _apply_orm(spec, codec, applied, keyed, using)
    sql = _Statement(spec, codec, conn)
    with conn.cursor() as cursor:
        for chunk in batched(applied, ROWS):
            cursor.execute(*sql.upsert(chunk, keyed))
            statements += 1
            if conn.vendor == "sqlite":
                _refuse_floats(spec, chunk, cursor.fetchall())
    return set(applied), statements


def _alive(codec: KeyCodec, keys: list, conn: Any) -> tuple[set, int]:
    """The keys whose foreign-key parts all have their parent row (locked where it can be)."""
    alive = set(keys)
    statements = 0
    qn = conn.ops.quote_name
    for i, field in enumerate(codec.fields):
        if not field.is_relation or not keys:
            continue
        parent = cast(Any, field.remote_field).model
        column = qn(target_field(field).column)
        wanted = sorted({key[i] for key in alive})
        found: set = set()
        for chunk in batched(wanted, ROWS):
            with conn.cursor() as cursor:
                cursor.execute(
                    f"SELECT {column} FROM {qn(parent._meta.db_table)} "
                    f"WHERE {column} IN ({', '.join(['%s'] * len(chunk))}) ORDER BY {column}"
                    f"{SHARE_LOCKS.get(conn.vendor, '')}",
                    [target_field(field).get_db_prep_value(v, conn) for v in chunk],
                )
                found.update(target_field(field).to_python(v) for (v,) in cursor.fetchall())
            statements += 1
        alive = {key for key in alive if key[i] in found}
    return alive, statements


class _Statement:
    """The upsert of one counter on one connection."""

    def __init__(self, spec: CounterSpec, codec: KeyCodec, conn: Any) -> None:
        qn = conn.ops.quote_name
        self.conn, self.codec = conn, codec
        meta = spec.model._meta
        value = model_field(spec.model, spec.value_field)
        self.value = qn(value.column)
        self.keys = [qn(f.column) for f in codec.fields]
        # A new row gets the other columns' defaults and the time in stamped ones, as save().
        self.others = [
            f
            for f in meta.concrete_fields
            if f not in (*codec.fields, value)
            and (stamped(f) or (f.has_default() and not f.has_db_default()))
            and not getattr(f, "generated", False)
        ]
        self.columns = ", ".join([*self.keys, self.value, *(qn(f.column) for f in self.others)])
        self.table = qn(meta.db_table)
        touched = [qn(f.column) for f in self.others if getattr(f, "auto_now", False)]
        if conn.vendor == "mysql":
            alias, ref = on_duplicate_key(conn)
            sets = [f"{self.value} = {self.value} + {ref(self.value)}"]
            sets += [f"{c} = {ref(c)}" for c in touched]
            self.tail = f"{alias} ON DUPLICATE KEY UPDATE {', '.join(sets)}"
        else:
            table = "t" if conn.vendor == "postgresql" else self.table
            sets = [f"{self.value} = {table}.{self.value} + EXCLUDED.{self.value}"]
            sets += [f"{c} = EXCLUDED.{c}" for c in touched]
            self.tail = f"ON CONFLICT ({', '.join(self.keys)}) DO UPDATE SET {', '.join(sets)}"
            if conn.vendor == "sqlite":
                self.tail += f" RETURNING typeof({self.value})"
            else:
                self.table += " AS t"

    def upsert(self, chunk: list, keyed: Mapping[Any, int]) -> tuple[str, list]:
        width = len(self.keys) + 1 + len(self.others)
        row = f"({', '.join(['%s'] * width)})"
        defaults = [f.get_db_prep_save(new_value(f), self.conn) for f in self.others]
        params: list = []
        for key in chunk:
            params += [*self.codec.db_values(key, self.conn), keyed[key], *defaults]
        sql = (
            f"INSERT INTO {self.table} ({self.columns}) "
            f"VALUES {', '.join([row] * len(chunk))} {self.tail}"
        )
        return sql, params


def _refuse_floats(spec: CounterSpec, chunk: list, rows: list) -> None:
    """SQLite turns an integer that overflows into an inexact float: refuse it as PostgreSQL
    does (the caller's transaction rolls the statement back)."""
    if any(kind != "integer" for (kind,) in rows):
        raise DataError(
            f"integer out of range: {spec.name} at one of {capped_keys(chunk)} would leave "
            "the 64-bit range of its column"
        )


def _apply_orm(
    spec: CounterSpec, codec: KeyCodec, keys: list, keyed: Mapping[Any, int], using: str
) -> int:
    """Any other database: lock or create each row in key order, then add. Not fast."""
    rows = spec.model._default_manager.using(using)
    names = [f.attname for f in codec.fields]
    value = spec.value_field
    for key in keys:
        lookup = dict(zip(names, key, strict=True))
        rows.select_for_update().get_or_create(**lookup, defaults={value: 0})
        rows.filter(**lookup).update(**{value: models.F(value) + keyed[key]})
    return 2 * len(keys)
