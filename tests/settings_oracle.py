"""The test settings plus a second database on Oracle (tests/oracle_like), where the counters
app's tables could be migrated: ``manage.py check`` must refuse it."""

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

DATABASES["legacy"] = {"ENGINE": "tests.oracle_like", "NAME": "legacy"}
