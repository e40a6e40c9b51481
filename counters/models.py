from django.db import models
from django.utils import timezone

#: Batch id prefix of direct writes (``fallback-<push id>``).
FALLBACK_PREFIX = "fallback-"


class FlushBatch(models.Model):
    """Ledger of applied batches: one row per batch, written in the same DB
    transaction as the counter updates it records. A batch id in this table
    has been applied; one that is not has not."""

    class Kind(models.TextChoices):
        FLUSH = "flush", "flush"
        FALLBACK = "fallback", "direct write (Redis unavailable)"

    batch_id = models.CharField(max_length=64, primary_key=True)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.FLUSH)
    shard = models.SmallIntegerField(null=True, blank=True)
    keys = models.PositiveIntegerField(default=0, help_text="Distinct counter keys in the batch.")
    deltas = models.BigIntegerField(default=0, help_text="Sum of absolute deltas applied.")
    dropped = models.PositiveIntegerField(
        default=0, help_text="Keys skipped because the row they count for no longer exists."
    )
    applied_at = models.DateTimeField(default=timezone.now, db_index=True)
    unsettled = models.JSONField(
        null=True,
        blank=True,
        help_text=(
            "Deltas of a direct write whose Redis push timed out and may still arrive; "
            "cleared once a flush has fenced that push."
        ),
    )

    class Meta:
        ordering = ["-applied_at"]
        indexes = [
            # Every read looks for unsettled direct writes: usually none, found at once.
            models.Index(
                fields=["applied_at"],
                name="counters_unsettled",
                condition=models.Q(unsettled__isnull=False),
            )
        ]
        verbose_name = "flush batch"
        verbose_name_plural = "flush batches"

    def __str__(self) -> str:
        return f"{self.kind} {self.batch_id} ({self.keys} keys)"


class BufferEpoch(models.Model):
    """What the DB knows of one Redis shard: its epoch marker and its batch sequence.

    Redis holds a random token per shard; this row remembers it. When the
    token in Redis is gone (Redis restarted empty) or differs, the deltas it
    buffered were lost. Redis also numbers the batches it moves; ``seq`` is
    the highest number applied, written in the same transaction as the batch.
    A Redis whose sequence is behind it came back from an older state (an old
    snapshot, a lagging replica). Either way the flush reports a loss, counts
    it here and marks the counters of the prefix as needing a rebuild until a
    full rebuild completes.
    """

    prefix = models.CharField(max_length=100)
    shard = models.PositiveSmallIntegerField()
    token = models.CharField(max_length=64)
    started_at = models.DateTimeField(default=timezone.now)
    losses = models.PositiveIntegerField(default=0)
    last_loss_at = models.DateTimeField(null=True, blank=True)
    seq = models.BigIntegerField(
        default=0, help_text="Highest batch sequence of this shard applied to the DB."
    )
    rebuild_needed_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text=(
            "First loss not yet repaired: counters stay wrong until a full rebuild that "
            "started after the last loss completes."
        ),
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["prefix", "shard"], name="counters_epoch_unique_shard")
        ]
        ordering = ["prefix", "shard"]

    def __str__(self) -> str:
        return f"{self.prefix} shard {self.shard}: {self.token}"


def describe_layout(prefix: str, shards: int, cluster: bool) -> str:
    """``prefix 'counters', 16 shards, Redis Cluster``: a buffer layout in messages."""
    return f"prefix {prefix!r}, {shards} shards{', Redis Cluster' if cluster else ''}"


class BufferLayout(models.Model):
    """A buffer layout that has written deltas: key prefix, shard count, Redis Cluster or not.

    Recorded by each process before its first push under the layout
    (:func:`counters.write.preflight.ensure_recorded`), so the DB knows every layout
    whose shards may hold deltas. A flush under another layout retires it
    (``retired_at``); it is drained once a complete flush that started after
    that found nothing of it left in Redis (``drained_at``). Until then reads
    miss its deltas, so the audit and rebuilds repair nothing, and the flush
    and ``counters_status`` report it.
    """

    prefix = models.CharField(max_length=100)
    shards = models.PositiveSmallIntegerField()
    cluster = models.BooleanField(default=False)
    first_seen_at = models.DateTimeField(default=timezone.now)
    retired_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When a flush under another layout took over; empty: in use.",
    )
    drained_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Start of the last complete flush that left nothing of it in Redis.",
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["prefix", "shards", "cluster"], name="counters_layout_unique"
            )
        ]
        ordering = ["first_seen_at", "pk"]
        verbose_name = "buffer layout"

    def __str__(self) -> str:
        return describe_layout(self.prefix, self.shards, self.cluster)


class AuditCursor(models.Model):
    """Where the continuous audit of one counter is: the last key it checked.

    Kept in the database the counter lives in (one row per counter), so a
    Redis that loses its data does not send every sweep back to the first key.
    """

    counter = models.CharField(max_length=100, primary_key=True)
    # NULL, not "": the empty string can be a key.
    after = models.TextField(  # noqa: DJ001
        null=True, blank=True, help_text="Last key checked; empty: the next run starts a sweep."
    )
    checked = models.BigIntegerField(default=0, help_text="Keys checked in the current sweep.")
    sweeps = models.PositiveIntegerField(default=0, help_text="Sweeps completed.")
    sweep_started_at = models.DateTimeField(null=True, blank=True)
    last_run_at = models.DateTimeField(null=True, blank=True)
    last_sweep_at = models.DateTimeField(
        null=True, blank=True, help_text="When the last complete sweep ended."
    )
    last_sweep_seconds = models.FloatField(
        null=True, blank=True, help_text="How long the last complete sweep took, start to end."
    )

    class Meta:
        ordering = ["counter"]
        verbose_name = "audit cursor"

    def __str__(self) -> str:
        return f"{self.counter}: after {self.after or '(start)'}, {self.sweeps} sweeps"


class AuditRepair(models.Model):
    """One counter the continuous audit found wrong and repaired.

    ``truth - stored - buffered`` was added through the delta path; the
    readings were taken just before, and the same difference was seen on
    several readings in a row.
    """

    counter = models.CharField(max_length=100)
    key = models.CharField(max_length=255)
    stored = models.BigIntegerField()
    buffered = models.BigIntegerField(help_text="Deltas still in Redis when it was read.")
    truth = models.BigIntegerField()
    repaired_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-repaired_at", "-pk"]
        indexes = [models.Index(fields=["counter", "key"], name="counters_audit_counter_key")]
        verbose_name = "audit repair"

    def __str__(self) -> str:
        return f"{self.counter} {self.key}: {self.delta:+d} at {self.repaired_at:%Y-%m-%d %H:%M:%S}"

    @property
    def delta(self) -> int:
        """What the repair added."""
        return self.truth - self.stored - self.buffered


class Outbox(models.Model):
    """Deltas of one committed transaction on one database, until Redis has them.

    Written only in durable mode (``COUNTERS_DURABLE``), inside the transaction
    whose deltas it holds, right before its COMMIT: one row per transaction and
    database, so no two writers ever touch the same row. The writer deletes it
    once its push is acknowledged (or in the transaction of its direct write
    when Redis fails). A row older than ``COUNTERS_OUTBOX_GRACE`` belongs to a
    writer that died or could not finish: the flush pushes it with the same
    push id, so Redis counts it once (see :mod:`counters.write.outbox`).
    """

    push_id = models.CharField(max_length=64, primary_key=True)
    deltas = models.JSONField(help_text="{member: delta} of the transaction.")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        # No index on created_at: the table holds only rows in flight (usually none),
        # and every index is one more write per counted transaction.
        ordering = ["created_at"]
        verbose_name = "outbox row"

    def __str__(self) -> str:
        return f"outbox {self.push_id} ({len(self.deltas or {})} deltas)"


class Tombstone(models.Model):
    """What a counter row held when its parent was deleted, until the key comes back.

    Only for counters keyed by a natural key (a foreign key ``to_field`` that
    is not an auto-increment), whose values can be used again. When the
    parent is deleted its counter row goes with it, but the deltas of its
    children's deletion (``-1`` each) are still buffered: the row's value is
    kept here, so ``row + tombstone + buffered`` stays the truth. A delta the
    flush drops because the parent is gone is added here as well (it nets to
    0 once every delta of the deleted parent is in). A parent created again
    with the same key takes the tombstone and adds its value to the buffer,
    in its own transaction: its counter then counts only its own children.
    """

    counter = models.CharField(max_length=200)
    key = models.CharField(max_length=255)
    value = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["counter", "key"], name="counters_tombstone_key")
        ]
        verbose_name = "counter tombstone"

    def __str__(self) -> str:
        return f"{self.counter}:{self.key} {self.value:+d}"


class RepairFence(models.Model):
    """The fencing token of the repairs of one key prefix, in the database they repair.

    Every repairer (an audit run, a rebuild, a retry or discard of the
    quarantine) takes the next token when it takes the rebuild lease, and
    each of its repairs runs in a transaction that first locks this row and
    checks that ``token`` is still its own (:mod:`counters.flushing.fence`). A repairer
    that stalled past its lease while another took a newer token changes
    nothing: the Redis lease says who should act, this row decides who can.
    """

    prefix = models.CharField(max_length=100, primary_key=True)
    token = models.BigIntegerField(default=0, help_text="The newest token issued.")
    issued_at = models.DateTimeField(default=timezone.now, help_text="When it was issued.")

    class Meta:
        ordering = ["prefix"]
        verbose_name = "repair fence"

    def __str__(self) -> str:
        return f"{self.prefix}: token {self.token}"


class CounterState(models.Model):
    """Whether a counter's stored values can be read: seen once per counter and database.

    A counter first seen while the table it counts already holds matching rows
    (and its ``into`` rows hold nothing yet) is *backfilling*: those rows were
    never counted, so reads return its truth (SQL) until a full rebuild of it
    completes (``backfilled_at``). See :mod:`counters.read.backfill`.
    """

    name = models.CharField(max_length=100, unique=True)
    first_seen_at = models.DateTimeField(default=timezone.now)
    backfilled_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When its stored values became exact; empty: backfilling, reads use the truth.",
    )

    class Meta:
        ordering = ["name"]
        verbose_name = "counter state"

    def __str__(self) -> str:
        return f"{self.name}: {'exact' if self.backfilled_at else 'backfilling'}"
