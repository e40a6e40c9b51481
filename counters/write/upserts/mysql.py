"""The applier of MySQL and MariaDB (InnoDB): an additive UPDATE per batch, then the rows it missed.

Nearly every key of a flush has its row already. For integer keys (the usual
foreign key to an auto-increment primary key) one statement adds every delta:
``UPDATE JSON_TABLE(%s, …) AS d STRAIGHT_JOIN t ON t.key = d.k SET t.n = t.n + d.n``.
The JSON array of ``[key, delta]`` pairs is to MySQL what ``unnest()`` of
two arrays is to PostgreSQL: one parameter, whatever the batch size.
``STRAIGHT_JOIN`` reads the pairs first, in the array's (key) order, and finds
each row through the key's unique index, so rows are locked in key order
(a multi-table UPDATE takes no ``ORDER BY``). With ``CLIENT.FOUND_ROWS``, which
Django's MySQL backend sets, the row count is the rows matched: when it is the
batch's size, nothing is missing and the batch took one statement. Otherwise
the UPDATE is rolled back to a savepoint taken before it: under READ COMMITTED
the rows it missed cannot be told apart from rows another applier created
since. Then, as for other key types, the rows that exist are locked first
(``SELECT … ORDER BY key FOR UPDATE``), and added to (with the joined UPDATE,
or one UPDATE per distinct delta for keys that are not integers).

Keys without a row go through ``INSERT … ON DUPLICATE KEY UPDATE n = n +
<new n>`` (a row another applier created meanwhile is added to). Only those:
InnoDB spends an auto-increment value on every row of such an INSERT, even one
that ends as an UPDATE, and an ``AutoField`` counter table would run out.
InnoDB checks a foreign key at once, not at COMMIT, and waits for a parent
row that a deleting transaction holds: so the parents of the missing keys are
read first with ``LOCK IN SHARE MODE`` (the latest committed rows, kept until
COMMIT) and keys whose parent is gone are left out.

A value leaving its column's range is ``DataError`` here, as on PostgreSQL
(Django's MySQL backend turns error 1690 into ``IntegrityError``, which the
flush would read as a ledger collision), so the quarantine isolates it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import DataError, IntegrityError, connections, transaction

from counters.base.registry import CounterSpec
from counters.base.utils import batched, on_duplicate_key
from counters.write.upserts.on_conflict import CHUNK, Names, prepared

#: ER_DATA_OUT_OF_RANGE ("BIGINT value is out of range") and ER_WARN_DATA_OUT_OF_RANGE.
OUT_OF_RANGE = (1690, 1264)


def apply_mysql(spec: CounterSpec, keyed: Mapping[Any, int], using: str) -> tuple[set, int]:
    """Add ``keyed`` ({key: delta}) to ``spec``'s rows, creating the missing ones whose
    parent exists; the keys applied and the statements run. Call inside a transaction."""
    conn = connections[using]
    n = Names(spec, conn)
    by_db = prepared(spec, keyed, conn)
    deltas = {k: keyed[v] for k, v in by_db.items()}
    integers = all(type(k) is int for k in by_db)
    applied: set = set()
    statements = 0
    with _ranged(spec), conn.cursor() as cursor:
        for chunk in batched(sorted(by_db), CHUNK):
            if integers:
                statements += 1
                if _all_rows_added(cursor, n, chunk, deltas, using):
                    applied.update(chunk)
                    continue
            # Some rows are missing (the attempt above, if any, was rolled back): lock those
            # that exist, add to them, create the others.
            existing = _lock(cursor, n, chunk)
            statements += 1 + _add(cursor, n, sorted(existing), deltas, conn, joined=integers)
            missing = [k for k in chunk if k not in existing]
            created, more = _create(cursor, n, missing, deltas, conn)
            statements += more
            applied.update(existing | created)
    return {by_db[k] for k in applied}, statements


def _all_rows_added(cursor: Any, n: Names, keys: list[int], deltas: dict, using: str) -> bool:
    """Add the deltas of ``keys`` if every one of them has its row, in one UPDATE.

    Under a savepoint: when the UPDATE matched fewer rows than keys, it is
    rolled back (its row locks stay), since which rows it missed cannot be
    told apart from rows created since by others (READ COMMITTED).
    """
    savepoint = transaction.savepoint(using)
    if _add_joined(cursor, n, keys, deltas, connections[using]) == len(keys):
        transaction.savepoint_commit(savepoint, using)
        return True
    transaction.savepoint_rollback(savepoint, using)
    return False


def _placeholders(count: int) -> str:
    return ", ".join(["%s"] * count)


def _add_joined(cursor: Any, n: Names, keys: list[int], deltas: dict, conn: Any) -> int:
    """One UPDATE of the rows of integer ``keys``, in key order; the rows matched."""
    pairs = json.dumps([[k, deltas[k]] for k in keys])
    return int(
        cursor.execute(
            f"UPDATE JSON_TABLE(%s, '$[*]' COLUMNS (k BIGINT PATH '$[0]', "
            f"n BIGINT PATH '$[1]')) AS d STRAIGHT_JOIN {n.table} AS t "
            f"ON t.{n.key} = d.k SET t.{n.value} = t.{n.value} + d.n{_touch(n, conn, 't.')}",
            [pairs, *n.touches(conn)],
        )
    )


def _touch(n: Names, conn: Any, alias: str) -> str:
    """``, <alias>col = %s`` for each ``auto_now`` column (its value: :meth:`Names.touches`)."""
    return "".join(f", {alias}{conn.ops.quote_name(f.column)} = %s" for f in n.touched)


def _lock(cursor: Any, n: Names, keys: list) -> set:
    """Lock the rows of ``keys`` in key order; the keys that have one."""
    cursor.execute(
        f"SELECT {n.key} FROM {n.table} WHERE {n.key} IN ({_placeholders(len(keys))}) "
        f"ORDER BY {n.key} FOR UPDATE",
        keys,
    )
    return {k for (k,) in cursor.fetchall()}


def _add(cursor: Any, n: Names, keys: list, deltas: dict, conn: Any, joined: bool) -> int:
    """Add to the (locked) rows of ``keys``: the joined UPDATE for integer keys, else one
    UPDATE per distinct delta. How many statements ran."""
    if not keys:
        return 0
    if joined:
        _add_joined(cursor, n, keys, deltas, conn)
        return 1
    by_delta: dict[int, list] = defaultdict(list)
    for key in keys:
        by_delta[deltas[key]].append(key)
    for delta, group in sorted(by_delta.items()):
        cursor.execute(
            f"UPDATE {n.table} SET {n.value} = {n.value} + %s{_touch(n, conn, '')} "
            f"WHERE {n.key} IN ({_placeholders(len(group))})",
            [delta, *n.touches(conn), *group],
        )
    return len(by_delta)


def _create(cursor: Any, n: Names, keys: list, deltas: dict, conn: Any) -> tuple[set, int]:
    """Create the rows of ``keys`` whose parent exists (adding to any created meanwhile);
    the keys created and the statements run."""
    if not keys:
        return set(), 0
    statements = 0
    if n.parent is not None:
        cursor.execute(
            f"SELECT {n.parent_key} FROM {n.parent} "
            f"WHERE {n.parent_key} IN ({_placeholders(len(keys))}) "
            f"ORDER BY {n.parent_key} LOCK IN SHARE MODE",
            keys,
        )
        alive = {k for (k,) in cursor.fetchall()}
        keys = [k for k in keys if k in alive]
        statements += 1
    if not keys:
        return set(), statements
    row = f"(%s, %s{n.other_params})"
    defaults = n.defaults(conn)
    alias, new = on_duplicate_key(conn)
    updates = [f"{n.value} = {n.table}.{n.value} + {new(n.value)}"]
    touched = [conn.ops.quote_name(f.column) for f in n.touched]
    updates += [f"{c} = {new(c)}" for c in touched]
    cursor.execute(
        f"INSERT INTO {n.table} ({n.key}, {n.value}{n.other_columns}) "
        f"VALUES {', '.join([row] * len(keys))}{alias} "
        f"ON DUPLICATE KEY UPDATE {', '.join(updates)}",
        [p for k in keys for p in (k, deltas[k], *defaults)],
    )
    return set(keys), statements + 1


@contextmanager
def _ranged(spec: CounterSpec) -> Iterator[None]:
    """Raise a value out of its column's range as ``DataError`` (see the module's docstring)."""
    try:
        yield
    except (IntegrityError, DataError) as exc:
        if exc.args and exc.args[0] in OUT_OF_RANGE:
            raise DataError(
                f"integer out of range: {spec.name} would leave the range of its column "
                f"({exc.args[-1]})"
            ) from exc
        raise
