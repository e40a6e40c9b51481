"""PostgreSQL triggers that audit every counter change and slow flush transactions down.

Audit: each change of an ``UnreadCounter`` row and each ``FlushBatch`` row
is recorded with the id of the transaction that made it. Rows written by a
transaction that rolled back vanish with it, so the audit holds exactly what
was committed, and the ledger can be checked against it: every committed
counter change belongs to a transaction that wrote one ledger row, a batch id
was committed by one transaction only, and each ledger row's ``keys`` and
``deltas`` match the changes of its transaction.

Latency: in flusher connections (``application_name`` ``tally-flusher-*``) a
ledger insert sleeps up to 20 ms, and so does COMMIT (a deferred constraint
trigger), so a kill or a terminated connection often lands inside the
transaction or inside COMMIT. A client killed during COMMIT leaves a batch
that is committed but still in flight in Redis: the next flush must only
acknowledge it.
"""

from __future__ import annotations

from django.db import connection

INSTALL = """
CREATE TABLE chaos_counter_audit (xid bigint NOT NULL, user_id bigint NOT NULL,
                                  delta bigint NOT NULL);
CREATE TABLE chaos_ledger_audit (xid bigint NOT NULL, batch_id text NOT NULL);

CREATE FUNCTION chaos_counter_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.count <> 0 THEN
      INSERT INTO chaos_counter_audit VALUES (txid_current(), NEW.user_id, NEW.count);
    END IF;
  ELSE
    INSERT INTO chaos_counter_audit VALUES (txid_current(), NEW.user_id, NEW.count - OLD.count);
  END IF;
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
  INSERT INTO chaos_ledger_audit VALUES (txid_current(), NEW.batch_id);
  PERFORM chaos_flusher_sleep();
  RETURN NULL;
END $$;

CREATE FUNCTION chaos_commit_sleep() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM chaos_flusher_sleep();
  RETURN NULL;
END $$;

CREATE TRIGGER chaos_counter_audit AFTER INSERT OR UPDATE ON notifications_unreadcounter
  FOR EACH ROW EXECUTE FUNCTION chaos_counter_audit();
CREATE TRIGGER chaos_ledger_audit AFTER INSERT ON counters_flushbatch
  FOR EACH ROW EXECUTE FUNCTION chaos_ledger_audit();
CREATE CONSTRAINT TRIGGER chaos_commit_sleep AFTER INSERT ON counters_flushbatch
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION chaos_commit_sleep();
"""

UNINSTALL = """
DROP TRIGGER IF EXISTS chaos_counter_audit ON notifications_unreadcounter;
DROP TRIGGER IF EXISTS chaos_ledger_audit ON counters_flushbatch;
DROP TRIGGER IF EXISTS chaos_commit_sleep ON counters_flushbatch;
DROP FUNCTION IF EXISTS chaos_counter_audit();
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
        WHERE NOT EXISTS (SELECT 1 FROM chaos_ledger_audit l WHERE l.xid = a.xid)""",
    "transactions that wrote more than one ledger row": """
        SELECT xid FROM chaos_ledger_audit GROUP BY xid HAVING count(*) > 1""",
    "batch ids committed by more than one transaction": """
        SELECT batch_id FROM chaos_ledger_audit GROUP BY batch_id HAVING count(*) > 1""",
    "ledger rows that do not match their transaction's changes": """
        SELECT b.batch_id, b.keys, b.deltas, count(a.xid), coalesce(sum(abs(a.delta)), 0)
        FROM counters_flushbatch b
        JOIN chaos_ledger_audit l ON l.batch_id = b.batch_id
        LEFT JOIN chaos_counter_audit a ON a.xid = l.xid
        GROUP BY b.batch_id, b.keys, b.deltas
        HAVING b.keys <> count(a.xid) OR b.deltas <> coalesce(sum(abs(a.delta)), 0)""",
    "ledger rows missing from the audit": """
        SELECT b.batch_id FROM counters_flushbatch b
        WHERE NOT EXISTS (SELECT 1 FROM chaos_ledger_audit l WHERE l.batch_id = b.batch_id)""",
    "counters that differ from the sum of their audited changes": """
        SELECT c.user_id, c.count, coalesce(s.total, 0) FROM notifications_unreadcounter c
        LEFT JOIN (SELECT user_id, sum(delta) AS total FROM chaos_counter_audit
                   GROUP BY user_id) s ON s.user_id = c.user_id
        WHERE c.count <> coalesce(s.total, 0)""",
}


def install() -> None:
    with connection.cursor() as cursor:
        cursor.execute(UNINSTALL)
        cursor.execute(INSTALL)


def uninstall() -> None:
    with connection.cursor() as cursor:
        cursor.execute(UNINSTALL)


def violations() -> dict[str, list[tuple]]:
    """Every broken invariant with (up to 10 of) the rows that break it."""
    found = {}
    with connection.cursor() as cursor:
        for name, sql in CHECKS.items():
            cursor.execute(sql + " LIMIT 10")
            rows = cursor.fetchall()
            if rows:
                found[name] = rows
    return found


def ledger_figures() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), count(DISTINCT batch_id), "
            "count(*) FILTER (WHERE kind = 'fallback') FROM counters_flushbatch"
        )
        rows, distinct, fallback = cursor.fetchone()
        cursor.execute("SELECT count(*) FROM chaos_counter_audit")
        (changes,) = cursor.fetchone()
    return {"batches": rows, "distinct_ids": distinct, "fallback": fallback, "changes": changes}
