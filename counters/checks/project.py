"""The project around the app: tracked models and their routes, the metrics directory, the
acknowledging middleware, the databases."""

from __future__ import annotations

import os

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections, router

from counters.base import backends, conf
from counters.base.metrics import MULTIPROC_ENV, multiprocess_dir
from counters.client import flushed_databases
from counters.tracking.queryset import CountedQuerySet
from counters.tracking.refusals import other_managers, problems, refused_models, uncounted_manager
from counters.tracking.trackers import all_trackers, tracked_models


@register("counters")
def check_trackers(app_configs=None, **kwargs):
    """Every tracked model counts its querysets: E013 for its default manager, W002 for others.

    Each declaration is checked again as ``track()`` checks it (E050 to E058): a
    counter registered into its column since, or a model changed since.
    """
    messages: list[CheckMessage] = []
    for tracker in all_trackers():
        for check_id, refused in problems(tracker):
            messages.append(
                Error(f"counter {tracker.name!r}: {refused}", obj=tracker.model, id=check_id)
            )
    for model in dict.fromkeys(t.model for t in all_trackers()):
        problem = uncounted_manager(model)
        if problem:
            messages.append(Error(f"{model._meta.label}: {problem}", obj=model, id="counters.E013"))
        for manager in model._meta.managers:
            if manager is model._default_manager:
                continue
            if not isinstance(manager.get_queryset(), CountedQuerySet):
                messages.append(
                    Warning(
                        f"{model._meta.label}.{manager.name} is not counted: its update() and "
                        "bulk_create() bypass the counters tracking the model",
                        hint="Give it a counters.CountedQuerySet, or use it only inside "
                        "counters.paused() followed by counters_rebuild.",
                        obj=model,
                        id="counters.W002",
                    )
                )
    return messages


@register(Tags.compatibility)
def check_metrics_dir(app_configs=None, **kwargs):
    """``PROMETHEUS_MULTIPROC_DIR``, when set, must be a writable directory (E018)."""
    path = multiprocess_dir()
    if path is None or (os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)):
        return []
    return [
        Error(
            f"{MULTIPROC_ENV} {path!r} is not a writable directory: metrics cannot be "
            "recorded and /metrics fails.",
            hint="Create it (empty) before the web and worker processes start.",
            id="counters.E018",
        )
    ]


@register("counters")
def check_routes(app_configs=None, **kwargs):
    """E045/E046: a model sharing a tracked model's rows has an uncounted route; W002: another
    manager of a proxy or multi-table relative is not counted (see counters.tracking.routes)."""
    messages: list[CheckMessage] = [
        Error(f"{model._meta.label}: {problem}", obj=model, id=check_id)
        for model, check_id, problem in refused_models()
    ]
    for model in tracked_models():
        for sharer, name in other_managers(model):
            messages.append(
                Warning(
                    f"{sharer._meta.label}.{name} is not counted: its update() and "
                    f"bulk_create() change rows of {model._meta.label} uncounted",
                    hint="Give it a counters.CountedQuerySet, or use it only inside "
                    "counters.paused() followed by counters_rebuild.",
                    obj=sharer,
                    id="counters.W002",
                )
            )
    return messages


ACKNOWLEDGE_MIDDLEWARE = "counters.middleware.AcknowledgeMiddleware"


@register("counters")
def check_acknowledge_middleware(app_configs=None, **kwargs):
    """W003: deferred acknowledgements without the middleware; W004: the middleware not first."""
    if not conf.get("COUNTERS_DEFER_ACKS"):
        return []
    middleware = list(getattr(settings, "MIDDLEWARE", None) or [])
    if ACKNOWLEDGE_MIDDLEWARE not in middleware:
        return [
            Warning(
                f"COUNTERS_DEFER_ACKS is on but {ACKNOWLEDGE_MIDDLEWARE} is not in MIDDLEWARE: "
                "a process serving requests waits for the reply of every push.",
                hint=f"Add {ACKNOWLEDGE_MIDDLEWARE!r} first in MIDDLEWARE.",
                id="counters.W003",
            )
        ]
    if middleware[0] != ACKNOWLEDGE_MIDDLEWARE:
        return [
            Warning(
                f"{ACKNOWLEDGE_MIDDLEWARE} is not first in MIDDLEWARE: a change committed by "
                "a middleware listed before it may be unacknowledged when its response leaves.",
                hint="Put it first, so it runs after every other middleware.",
                id="counters.W004",
            )
        ]
    return []


def _counter_databases() -> list[str]:
    """Aliases that may hold the counters app's tables, or that a flush drains."""
    migrated = [alias for alias in connections if router.allow_migrate(alias, "counters")]
    return list(dict.fromkeys([*migrated, *flushed_databases()]))


@register(Tags.database, Tags.compatibility)
def check_databases(app_configs=None, databases=None, **kwargs):
    """E090: a database the app has no statements for; E091: MySQL not at READ COMMITTED;
    E092 (``check --database``, which connects): MySQL tables not in InnoDB."""
    return [
        Error(reason, hint=hint, id=check_id)
        for alias in _counter_databases()
        if alias in connections  # an unknown alias in COUNTERS_DATABASES fails at its flush
        for check_id, reason, hint in backends.problems(
            alias, connections[alias], connect=alias in (databases or ())
        )
    ]
