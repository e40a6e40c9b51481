"""PostgreSQL triggers that audit every counter change and slow flush transactions down.

Audit: each change of a counter's column (the counters named to
:func:`install`, e.g. ``unread``'s ``UnreadCounter.count``, or two counters
in two columns of one ``RelAuthorStats`` row) and each ``FlushBatch`` row is
recorded with the id of the transaction that made it (a ledger row with the
``application_name`` of its connection too: which flusher committed it). Rows written by a
transaction that rolled back vanish with it, so the audit holds exactly what
was committed, and the ledger can be checked against it: every committed
counter change belongs to a transaction that wrote one ledger row, a batch id
was committed by one transaction only, and each ledger row's ``keys`` and
``deltas`` match the changes of its transaction, netted per counter and key.

Deletions are recorded too, as changes of minus the row's values. A counter
row deleted with its parent (a ``CASCADE``, in the deleting transaction) is
not a change to ledger: its key never comes back. A flush that created a row
whose parent another transaction deleted meanwhile deletes that row again
and drops its delta (:func:`counters.write.upserts.on_conflict.upsert_postgresql`): its
insertion and its deletion net to nothing, as its ledger row counts it.

Latency: in flusher connections (``application_name`` ``tally-flusher-*``) a
ledger insert sleeps up to 20 ms, and so does COMMIT (a deferred constraint
trigger), so a kill or a terminated connection often lands inside the
transaction or inside COMMIT. A client killed during COMMIT leaves a batch
that is committed but still in flight in Redis: the next flush must only
acknowledge it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django.db import connection

from counters.base.registry import get_spec
from counters.base.utils import model_field
from tests.chaos.harness import CeleryFlusher, CommandFlusher

INSTALL = """
CREATE TABLE chaos_counter_audit (xid bigint NOT NULL, counter text NOT NULL, key text NOT NULL,
                                  delta bigint NOT NULL, deleted boolean NOT NULL);
CREATE TABLE chaos_ledger_audit (xid bigint NOT NULL, batch_id text NOT NULL, app text NOT NULL);

-- Arguments: the key column, then pairs of (value column, counter name).
CREATE FUNCTION chaos_counter_audit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  new_row jsonb := CASE WHEN TG_OP <> 'DELETE' THEN to_jsonb(NEW) END;
  old_row jsonb := CASE WHEN TG_OP <> 'INSERT' THEN to_jsonb(OLD) END;
  delta bigint;
BEGIN
  FOR i IN 1 .. TG_NARGS - 1 BY 2 LOOP
    delta := coalesce((new_row ->> TG_ARGV[i])::bigint, 0)
             - coalesce((old_row ->> TG_ARGV[i])::bigint, 0);
    IF delta <> 0 THEN
      INSERT INTO chaos_counter_audit
        VALUES (txid_current(), TG_ARGV[i + 1], coalesce(new_row, old_row) ->> TG_ARGV[0], delta,
                TG_OP = 'DELETE');
    END IF;
  END LOOP;
  RETURN NULL;
END $$;

CREATE FUNCTION chaos_flusher_sleep() RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  IF current_setting('application_name') LIKE 'tally-flusher%' THEN
    PERFORM pg_sleep(random() * 0.02);
  END IF;
END $$;

CREATE FUNCTION chaos_ledger_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO chaos_ledger_audit
    VALUES (txid_current(), NEW.batch_id, current_setting('application_name'));
  PERFORM chaos_flusher_sleep();
  RETURN NULL;
END $$;

CREATE FUNCTION chaos_commit_sleep() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM chaos_flusher_sleep();
  RETURN NULL;
END $$;

CREATE TRIGGER chaos_ledger_audit AFTER INSERT ON counters_flushbatch
  FOR EACH ROW EXECUTE FUNCTION chaos_ledger_audit();
CREATE CONSTRAINT TRIGGER chaos_commit_sleep AFTER INSERT ON counters_flushbatch
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION chaos_commit_sleep();
"""

COUNTER_TRIGGER = """
CREATE TRIGGER chaos_counter_audit AFTER INSERT OR UPDATE OR DELETE ON {table}
  FOR EACH ROW EXECUTE FUNCTION chaos_counter_audit({args})
"""

# CASCADE drops the counter tables' triggers with their function.
UNINSTALL = """
DROP TRIGGER IF EXISTS chaos_ledger_audit ON counters_flushbatch;
DROP TRIGGER IF EXISTS chaos_commit_sleep ON counters_flushbatch;
DROP FUNCTION IF EXISTS chaos_counter_audit() CASCADE;
DROP FUNCTION IF EXISTS chaos_ledger_audit();
DROP FUNCTION IF EXISTS chaos_commit_sleep();
DROP FUNCTION IF EXISTS chaos_flusher_sleep();
DROP TABLE IF EXISTS chaos_counter_audit;
DROP TABLE IF EXISTS chaos_ledger_audit;
"""

#: Name of each check → SQL returning the rows that break it (none when it holds).
CHECKS = {
    "counter changes outside a ledgered transaction": """
        SELECT DISTINCT a.xid FROM chaos_counter_audit a
        WHERE NOT a.deleted
          AND NOT EXISTS (SELECT 1 FROM chaos_ledger_audit l WHERE l.xid = a.xid)""",
    "transactions that wrote more than one ledger row": """
        SELECT xid FROM chaos_ledger_audit GROUP BY xid HAVING count(*) > 1""",
    "batch ids committed by more than one transaction": """
        SELECT batch_id FROM chaos_ledger_audit GROUP BY batch_id HAVING count(*) > 1""",
    "ledger rows that do not match their transaction's changes": """
        SELECT b.batch_id, b.keys, b.deltas, count(n.xid), coalesce(sum(abs(n.net)), 0)
        FROM counters_flushbatch b
        JOIN chaos_ledger_audit l ON l.batch_id = b.batch_id
        LEFT JOIN (SELECT xid, sum(delta) AS net FROM chaos_counter_audit
                   GROUP BY xid, counter, key HAVING sum(delta) <> 0) n ON n.xid = l.xid
        GROUP BY b.batch_id, b.keys, b.deltas
        HAVING b.keys <> count(n.xid) OR b.deltas <> coalesce(sum(abs(n.net)), 0)""",
    "ledger rows missing from the audit": """
        SELECT b.batch_id FROM counters_flushbatch b
        WHERE NOT EXISTS (SELECT 1 FROM chaos_ledger_audit l WHERE l.batch_id = b.batch_id)""",
}

SUM_CHECK = """
    SELECT %s, c.{key}::text, c.{value}, coalesce(s.total, 0) FROM {table} c
    LEFT JOIN (SELECT key, sum(delta) AS total FROM chaos_counter_audit WHERE counter = %s
               GROUP BY key) s ON s.key = c.{key}::text
    WHERE c.{value} <> coalesce(s.total, 0)"""


@dataclass(frozen=True)
class Column:
    """Where a counter keeps its values: its table, key column and value column."""

    name: str
    table: str
    key: str
    value: str

    @classmethod
    def of(cls, name: str) -> Column:
        spec = get_spec(name)
        if spec.codec is not None:
            raise ValueError(f"the chaos audit takes counters of one key column; {name!r} has more")
        key = spec.key_model_field.column
        value = model_field(spec.model, spec.value_field).column
        assert key and value, f"{name}: a key or value field without a column"
        return cls(name=name, table=spec.model._meta.db_table, key=key, value=value)

    def sum_check(self) -> str:
        qn = connection.ops.quote_name
        return SUM_CHECK.format(table=qn(self.table), key=qn(self.key), value=qn(self.value))


def literal(text: str) -> str:
    """``text`` as an SQL string literal (trigger arguments cannot be parameters)."""
    return "'" + text.replace("'", "''") + "'"


def install(names: Sequence[str]) -> None:
    """Audit the counters ``names`` (their tables' INSERTs, UPDATEs and DELETEs) and the ledger.

    Counters sharing a table must share its key column: one trigger per table
    records each of their columns.
    """
    tables: dict[str, list[Column]] = {}
    for column in map(Column.of, names):
        tables.setdefault(column.table, []).append(column)
    with connection.cursor() as cursor:
        cursor.execute(UNINSTALL)
        cursor.execute(INSTALL)
        for table, columns in tables.items():
            if len({c.key for c in columns}) != 1:
                raise ValueError(f"the counters of {table} are keyed by different columns")
            args = [columns[0].key]
            for c in columns:
                args += [c.value, c.name]
            cursor.execute(
                COUNTER_TRIGGER.format(
                    table=connection.ops.quote_name(table), args=", ".join(map(literal, args))
                )
            )


def uninstall() -> None:
    with connection.cursor() as cursor:
        cursor.execute(UNINSTALL)


def violations(names: Sequence[str]) -> dict[str, list[tuple]]:
    """Every broken invariant with (up to 10 of) the rows that break it.

    Beyond :data:`CHECKS`, the rows of each counter in ``names`` must equal
    the sum of their audited changes.
    """
    found = {}
    with connection.cursor() as cursor:
        for name, sql in CHECKS.items():
            cursor.execute(sql + " LIMIT 10")
            if rows := cursor.fetchall():
                found[name] = rows
        for c in map(Column.of, names):
            cursor.execute(c.sum_check() + " LIMIT 10", [c.name, c.name])
            if rows := cursor.fetchall():
                found[f"{c.name}: rows that differ from the sum of their audited changes"] = rows
    return found


def ledger_figures() -> dict[str, int]:
    """The ledger's rows (all, distinct, direct writes), the audited counter changes, and the
    ledger rows committed by each flusher (by the ``application_name`` of its connection)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), count(DISTINCT batch_id), "
            "count(*) FILTER (WHERE kind = 'fallback') FROM counters_flushbatch"
        )
        rows, distinct, fallback = cursor.fetchone()
        cursor.execute("SELECT count(*) FROM chaos_counter_audit WHERE NOT deleted")
        (changes,) = cursor.fetchone()
        cursor.execute("SELECT app, count(*) FROM chaos_ledger_audit GROUP BY app")
        by_app = dict(cursor.fetchall())
    return {
        "batches": rows,
        "distinct_ids": distinct,
        "fallback": fallback,
        "changes": changes,
        "command_batches": by_app.get(CommandFlusher.APP, 0),
        "celery_batches": by_app.get(CeleryFlusher.APP, 0),
    }
