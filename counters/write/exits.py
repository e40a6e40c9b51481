"""Work a process must finish before it ends: the hooks of every way a Python process exits.

Registered once per process and function (:func:`on_exit`):

- ``atexit``, at interpreter exit;
- the finalizers of a ``multiprocessing`` child, which ends with
  ``os._exit()`` and skips ``atexit``;
- ``uwsgi.atexit`` in a uWSGI worker.

A Celery prefork child and a gunicorn worker skip them too: they call
``counters.drain_queues()`` from ``worker_process_shutdown`` and
``worker_exit`` (``config/gunicorn.py``). A child after ``fork()`` starts
with none registered (``multiprocessing`` clears its finalizers).
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import sys
from collections.abc import Callable
from typing import Any

_registered: set[Callable[[], None]] = set()


def on_exit(func: Callable[[], None]) -> None:
    """Call ``func()`` when this process exits, however it does; idempotent."""
    if func in _registered:
        return
    _registered.add(func)
    atexit.register(func)
    multiprocessing.util.Finalize(None, func, exitpriority=100)
    uwsgi: Any = sys.modules.get("uwsgi")
    if uwsgi is not None:
        previous = getattr(uwsgi, "atexit", None)

        def uwsgi_atexit() -> None:
            func()
            if callable(previous):
                previous()

        uwsgi.atexit = uwsgi_atexit


def _forget_in_child() -> None:
    _registered.clear()  # a multiprocessing child starts with no finalizers


os.register_at_fork(after_in_child=_forget_in_child)
