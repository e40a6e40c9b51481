"""gunicorn settings of the production web process (``Procfile.production``).

Only the hooks live here; the command line sets the rest.
"""

from __future__ import annotations

import os
from typing import Any

import counters


def child_exit(server: Any, worker: Any) -> None:
    """A worker ended (restarted, killed, shut down): drop its live Prometheus gauges.

    In prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) each
    worker writes its values to files of its own; those of ``livesum`` gauges
    must go with the worker, while counters keep what it counted.
    """
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


def worker_exit(server: Any, worker: Any) -> None:
    """A worker is exiting: push the deltas its counters sender still holds."""
    counters.drain_queues()
