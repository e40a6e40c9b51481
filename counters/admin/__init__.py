"""The counters app's admin: its bookkeeping, the page of every counter's state, and
:class:`CounterAdmin` for the models counters are stored in.

::

    from counters.admin import CounterAdmin

    admin.site.register(PostStats, CounterAdmin)
"""

from counters.admin import bookkeeping, overview
from counters.admin.counter import CounterAdmin

__all__ = ["CounterAdmin", "bookkeeping", "overview"]
