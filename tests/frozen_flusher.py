"""A flusher that freezes itself (SIGSTOP) inside its apply transaction, like a paused VM.

Run as ``python -m tests.frozen_flusher`` with the environment of
:func:`tests.procs.project_env`. Once the deltas of its first batch are
applied and before its transaction commits, it prints ``frozen <backend pid>``
(the PostgreSQL backend of its connection, 0 elsewhere) and stops itself.
After SIGCONT it commits, acknowledges, and prints the flush's summary.
"""

from __future__ import annotations

import os
import signal

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


def main() -> None:
    import django

    django.setup()
    from django.db import connection

    import counters
    from counters.flushing import shard as flusher

    real = flusher.apply_deltas
    frozen = False

    def apply_then_freeze(deltas, using):
        nonlocal frozen
        applied = real(deltas, using)
        if not frozen:
            frozen = True
            pid = 0
            if connection.vendor in ("postgresql", "mysql"):
                from tests.helpers import backend_pid

                pid = backend_pid()
            print(f"frozen {pid}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return applied

    flusher.apply_deltas = apply_then_freeze
    print(counters.flush(using="default").summary(), flush=True)


if __name__ == "__main__":
    main()
