"""Apply deltas to counter rows: additive ``F()`` updates grouped by delta value."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.db import connections, models

from .registry import CounterSpec, get_spec
from .utils import batched

logger = logging.getLogger(__name__)

#: Largest IN list sent in one statement (below every backend's parameter limit).
CHUNK = 5000


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
    to_field = spec.key_model_field.remote_field.field_name
    alive: set = set()
    for chunk in batched(keys, CHUNK):
        alive.update(
            target._default_manager.using(using)
            .filter(**{f"{to_field}__in": chunk})
            .values_list(to_field, flat=True)
        )
    return alive


def _add(qs, attname: str, value: str, keyed: Mapping[Any, int]) -> tuple[int, int]:
    """One additive UPDATE per distinct delta; returns (rows updated, statements)."""
    by_delta: dict[int, list] = defaultdict(list)
    for key, delta in keyed.items():
        by_delta[delta].append(key)
    conn = connections[qs.db]
    if conn.vendor == "postgresql":
        return _add_postgresql(conn, qs.model, attname, value, by_delta)
    updated = statements = 0
    for delta, group in sorted(by_delta.items()):
        for chunk in batched(group, CHUNK):
            updated += qs.filter(**{f"{attname}__in": chunk}).update(
                **{value: models.F(value) + delta}
            )
            statements += 1
    return updated, statements


def _add_postgresql(conn, model, attname: str, value: str, by_delta) -> tuple[int, int]:
    """The same UPDATEs with the keys as one array parameter (``= ANY(%s)``).

    Same statements, same locks; it only spares building and parsing a SQL
    text with a placeholder per key, which is most of the flusher's CPU. Keys
    go in sorted order, so concurrent appliers (a flush and a direct write)
    lock rows in the same order.
    """
    meta = model._meta
    qn = conn.ops.quote_name
    key_field = meta.get_field(attname) if attname != meta.pk.attname else meta.pk
    column = qn(meta.get_field(value).column)
    sql = (
        f"UPDATE {qn(meta.db_table)} SET {column} = {column} + %s "
        f"WHERE {qn(key_field.column)} = ANY(%s)"
    )
    updated = 0
    with conn.cursor() as cursor:
        for delta, group in sorted(by_delta.items()):
            keys = sorted(key_field.get_db_prep_value(k, conn) for k in group)
            cursor.execute(sql, [delta, keys])
            updated += cursor.rowcount
    return updated, len(by_delta)


def apply_spec(spec: CounterSpec, keyed: Mapping[Any, int], using: str) -> Applied:
    """Add ``keyed`` ({key: delta}) to ``spec``'s rows. Call inside a transaction.

    The additive UPDATEs go first: when every row exists (the steady state)
    that is all. Otherwise the missing rows are found, created at 0 (unless
    the row they count for is gone: those deltas are dropped) and updated.
    """
    model = spec.model
    qs = model._default_manager.using(using)
    attname, value = spec.key_attname, spec.value_field
    updated, statements = _add(qs, attname, value, keyed)
    dropped: set = set()
    if updated < len(keyed):
        keys = list(keyed)
        existing: set = set()
        for chunk in batched(keys, CHUNK):
            existing.update(qs.filter(**{f"{attname}__in": chunk}).values_list(attname, flat=True))
            statements += 1
        missing = [k for k in keys if k not in existing]
        alive = _alive(spec, missing, using)
        dropped = set(missing) - alive
        if alive:
            qs.bulk_create(
                [model(**{attname: k, value: 0}) for k in alive],
                ignore_conflicts=True,
                batch_size=CHUNK,
            )
            _, more = _add(qs, attname, value, {k: keyed[k] for k in alive})
            statements += 1 + more
    if dropped:
        logger.warning(
            "dropped deltas of %s vanished %s keys: %s",
            len(dropped),
            spec.name,
            sorted(dropped)[:20],
        )
    return Applied(
        keys=len(keyed) - len(dropped),
        deltas=sum(abs(d) for k, d in keyed.items() if k not in dropped),
        dropped=len(dropped),
        statements=statements,
    )


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
