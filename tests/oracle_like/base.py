"""A database backend that says it is Oracle and connects nowhere (Django's dummy backend).

Oracle's own backend needs its driver to load at all; the counters app's check
needs only ``vendor`` and ``display_name``, which these are.
"""

from django.db.backends.dummy.base import DatabaseWrapper as DummyDatabaseWrapper


class DatabaseWrapper(DummyDatabaseWrapper):
    vendor = "oracle"
    display_name = "Oracle"
