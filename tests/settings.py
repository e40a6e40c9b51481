"""Settings of the test suite: the project's settings plus a second database, "other".

"other" uses the engine of "default" (SQLite: a file of its own; PostgreSQL,
MySQL/MariaDB: the same server), with a test database name of this run alone, so tests can
check that each database gets its own deltas. Subprocesses started by the
tests (tests/procs.py) run with ``config.settings`` and one database.
"""

from __future__ import annotations

import os

from config.settings import *  # noqa: F403
from config.settings import DATABASES, INSTALLED_APPS, VAR_DIR

_default = DATABASES["default"]
if _default["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["other"] = {
        **_default,
        "NAME": str(VAR_DIR / "tally-other.sqlite3"),
        "TEST": {"NAME": str(VAR_DIR / f"test-tally-other-{os.getpid()}.sqlite3")},
    }
else:
    DATABASES["other"] = {
        **_default,
        "NAME": f"{_default['NAME']}_other",
        "TEST": {**_default.get("TEST", {}), "NAME": f"test_tally_other_{os.getpid()}"},
    }

# A flush without an alias drains only "default" here: tests that declare only
# "default" must not touch "other" (pytest-django refuses queries to databases
# a test did not ask for). Tests of several databases set this themselves.
COUNTERS_DATABASES = ["default"]

# The fault injections of the suite patch the push a COMMIT waits on (Buffer.push,
# Buffer._run). The deferred acknowledgements (the default) have tests of their own, with
# real Redis servers killed and stopped (tests/write/test_acks.py), and run in every
# process the tests start (config.settings): the chaos suite, e2e, web.
COUNTERS_DEFER_ACKS = False

# The counters app's own test app: a blog counting its comments with counters.track().
INSTALLED_APPS = [*INSTALLED_APPS, "tests.blog", "tests.deletes"]
