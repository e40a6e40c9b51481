"""New counters over existing rows: read their truth until their first full rebuild.

A counter declared on a table that already holds rows starts from nothing:
the rows written before it existed were never counted. Its stored row plus
buffered deltas is then a partial count, and a read must not show it as
exact. So each counter is *seen* once per database (:class:`CounterState`):

- first seen while its counted table holds rows matching its ``where`` and
  none of its ``into`` rows holds a value yet: it is **backfilling**. Reads
  return its truth (the SQL ``COUNT``/``SUM`` a rebuild uses) and the flush
  starts a full rebuild of it; once one completes it is exact;
- otherwise (the table is empty, or the ``into`` rows already hold values: a
  counter that was counting before this state was kept, or a column kept by
  other means) it is exact from the start.

A counter without a truth source is always exact (nothing could backfill it).
A counter is seen after every ``migrate`` (and ``flush``) of its database, at
the start of every flush, by ``counters_status`` and by its first read. A
state once exact never goes back, so it is cached per process: reading an
exact counter costs nothing more after the first read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DatabaseError, models, router, transaction
from django.utils import timezone

from counters.base.registry import CounterSpec, all_specs
from counters.models import CounterState

logger = logging.getLogger(__name__)

BACKFILLING = "backfilling"
EXACT = "exact"

#: (database alias, counter name) of the counters known to be exact in this process.
_exact: set[tuple[str, str]] = set()


def forget() -> None:
    """Forget what this process knows of the states (a test that drops them calls it)."""
    _exact.clear()


def is_backfilling(spec: CounterSpec, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Whether reads of ``spec`` must return its truth (seeing it first if never seen)."""
    if spec.source is None or (using, spec.name) in _exact:
        return False
    return spec.name in see([spec], using)


def see(
    specs: Iterable[CounterSpec], using: str = DEFAULT_DB_ALIAS, *, after_migrate: bool = False
) -> set[str]:
    """Record the state of the counters never seen in ``using``; returns those backfilling.

    A database where no counter was ever seen (no state at all: the table was
    emptied, by a test's flush for instance) takes the counters as exact,
    except right after ``migrate``, which sees every counter first: it fills
    the table as soon as it is created, so a deployment always has states.
    """
    todo = {
        s.name: s
        for s in specs
        if s.source is not None
        and (using, s.name) not in _exact
        and router.allow_migrate_model(using, s.model)
    }
    if not todo:
        return set()
    states = CounterState.objects.using(using)
    try:
        with transaction.atomic(using=using):  # a missing table must not break the caller's
            known = dict(states.filter(name__in=todo).values_list("name", "backfilled_at"))
            fresh = not after_migrate and len(known) < len(todo) and not states.exists()
    except DatabaseError as exc:
        logger.warning("counter states of %r unknown (not migrated?): %s", using, exc)
        return set()  # as before states were kept: stored + buffered
    for name, spec in todo.items():
        if name not in known:
            try:
                with transaction.atomic(using=using):
                    known[name] = _first_seen(spec, using, fresh)
            except DatabaseError as exc:  # its tables are elsewhere: read as before
                logger.warning("counter %s not seen in %r: %s", name, using, exc)
    backfilling = set()
    for name, done in known.items():
        if done is None:
            backfilling.add(name)
        else:
            _exact.add((using, name))
    return backfilling


def _first_seen(spec: CounterSpec, using: str, fresh: bool) -> Any:
    """Decide and record the state of a counter never seen; returns its ``backfilled_at``."""
    now = timezone.now()
    done = None if not fresh and _uncounted_rows(spec, using) else now
    # Seen by another process meanwhile: its decision stands (get_or_create reads it).
    row, created = CounterState.objects.using(using).get_or_create(
        name=spec.name, defaults={"first_seen_at": now, "backfilled_at": done}
    )
    if created and done is None:
        logger.warning(
            "counter %s is new over existing rows: it reads its truth (SQL) until a full "
            "rebuild completes; the flush starts one",
            spec.name,
        )
    return row.backfilled_at


def _uncounted_rows(spec: CounterSpec, using: str) -> bool:
    """Whether the counted table holds matching rows while no ``into`` row holds a value."""
    stored: models.QuerySet[Any, Any] = models.QuerySet(spec.model, using=using).exclude(
        **{spec.value_field: 0}
    )
    if stored.exists():
        return False
    tracker = getattr(spec.source, "tracker", None)
    model = getattr(tracker, "model", None)
    if model is None:  # another kind of truth: any key of it may hold rows
        assert spec.source is not None
        return bool(spec.source.keys_after(None, 1, using=using))
    rows: models.QuerySet[Any, Any] = models.QuerySet(model, using=using)
    where = getattr(tracker, "where", None)
    if where is not None:
        rows = rows.filter(where)
    return rows.exists()


def truth_values(spec: CounterSpec, keys: Iterable[Any], using: str) -> dict[Any, int]:
    """The truth of ``keys`` (the caller's keys; a key without rows is 0)."""
    assert spec.source is not None
    normal = {key: spec.normalize(key) for key in dict.fromkeys(keys)}
    if not normal:
        return {}
    truth = spec.source.count_for(list(dict.fromkeys(normal.values())), using=using)
    return {key: truth.get(value, 0) for key, value in normal.items()}


def backfilling(using: str = DEFAULT_DB_ALIAS) -> list[str]:
    """The registered counters of ``using`` still backfilling, seeing the others first."""
    return sorted(see(all_specs(), using))


def mark_done(name: str, using: str = DEFAULT_DB_ALIAS) -> bool:
    """A full rebuild of ``name`` completed: its stored values are exact from now on.

    Returns whether it was backfilling until now.
    """
    now = timezone.now()
    states = CounterState.objects.using(using)
    ended = states.filter(name=name, backfilled_at__isnull=True).update(backfilled_at=now)
    if not ended:
        states.get_or_create(name=name, defaults={"first_seen_at": now, "backfilled_at": now})
    _exact.add((using, name))
    if ended:
        logger.warning("counter %s is backfilled: reads use its stored values again", name)
    return bool(ended)


def status(using: str = DEFAULT_DB_ALIAS) -> dict[str, Any]:
    """What ``counters_status`` shows: each counter's state, the backfilling ones first."""
    names = set(backfilling(using))
    rows = {s.name: s for s in CounterState.objects.using(using)}
    counters = {}
    for spec in all_specs():
        row = rows.get(spec.name)
        counters[spec.name] = {
            "state": BACKFILLING if spec.name in names else EXACT,
            "first_seen_at": row.first_seen_at.isoformat() if row else None,
            "backfilled_at": row.backfilled_at.isoformat() if row and row.backfilled_at else None,
        }
    return {"backfilling": sorted(names), "counters": counters}


def seen_after_migrate(using: str = DEFAULT_DB_ALIAS, **kwargs: Any) -> None:
    """``post_migrate`` (and ``flush``): see the counters whose tables ``using`` holds."""
    if not router.allow_migrate_model(using, CounterState):
        return
    try:
        see(all_specs(), using, after_migrate=True)
    except DatabaseError as exc:  # migrated back before the state's table, or a table absent
        logger.warning("counter states of database %r not recorded: %s", using, exc)
